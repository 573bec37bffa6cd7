"""Hostile embedded programs: bundles whose ``meta.program`` was edited the way an attacker would.

Each attack starts from a valid bundle whose step program was exported by a real ``Recorder``
(kind ``loss``: forward and loss function), then edits the program JSON: nodes that write or read
files, higher-order ops that name Python callables, tree specs that import modules, symbolic
expressions that never finish, sizes that exhaust memory, strings and in-place writes where none
belong, and plain damage. ``tests/engine/test_program_attacks.py`` replays each one with an empty trust
store and no code of the user's (the embedded program is the only way to replay), and checks the
exit code, the message, the marker files and the time.

``python tests/attacks/program_attacks.py OUTDIR`` writes the files (and ``index.json``).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(HERE.parents[1]))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from attacks.make_attacks import read_manifest, write_manifest  # noqa: E402
from nanreplay import NonFiniteGradientError, Recorder  # noqa: E402

PROBE = "nanreplay_program_probe"  # a module the attacks name; importing it creates the marker


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.bn(self.fc(x)))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x = batch["x"]
    return model(x).sum() / x.abs().sum()  # 0 / 0 = NaN for an all-zero batch


def record_base(out: Path) -> Path:
    """A valid bundle with an embedded loss program; the factory is not recorded, so the program
    is the only way a replay without user code can go."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        with Recorder(model, opt, loss_fn=loss, out_dir=out, capacity=2, diagnose=False) as rec:
            for step in range(3):
                batch = {"x": torch.zeros(3, 4) if step == 2 else torch.randn(3, 4)}
                rec.record(batch)
                value = loss(model, batch)
                rec.log_loss(value)
                value.backward()
                opt.step()
                opt.zero_grad()
    except NonFiniteGradientError as e:
        return Path(e.bundle_path)
    raise AssertionError("the base bundle's step did not fail")


@dataclass
class ProgramAttack:
    name: str
    what: str
    edit: Callable[[dict, Path], None]  # edits the program record in place; gets the output folder
    exit: int  # of `nanreplay replay BUNDLE` with no user code
    says: str  # text the output must contain
    inspect: int = 0
    bounded: bool = False  # replayed in a child process with an address-space limit and a heap marker


def _graph(prog: dict) -> dict:
    return prog["program"]["graph_module"]["graph"]


def _node(prog: dict, target_part: str) -> dict:
    return next(n for n in _graph(prog)["nodes"] if target_part in n["target"])


def _first_tensor_input(prog: dict) -> str:
    sig = prog["program"]["graph_module"]["signature"]["input_specs"]
    return next(s["user_input"]["arg"]["as_tensor"]["name"] for s in sig if "user_input" in s)


def _tensor_value(prog: dict, name: str, sizes: list[int], dtype: int = 1) -> None:
    _graph(prog)["tensor_values"][name] = {
        "dtype": dtype, "sizes": [{"as_int": s} for s in sizes], "requires_grad": False,
        "device": {"type": "cpu", "index": None}, "strides": [{"as_int": 1} for _ in sizes],
        "storage_offset": {"as_int": 0}, "layout": 7,
    }


def _root_meta(prog: dict) -> dict:
    """The metadata of a node of the export root (its module stack), which torch's unflatten needs."""
    stack = next(n["metadata"]["nn_module_stack"] for n in reversed(_graph(prog)["nodes"]) if n.get("metadata", {}).get("nn_module_stack"))
    return {"nn_module_stack": stack.split(";")[0]}


def _insert(prog: dict, nodes: list[dict]) -> None:
    for n in nodes:
        n["metadata"] = n.get("metadata") or _root_meta(prog)
    _graph(prog)["nodes"][0:0] = nodes


def _arg(name: str, **arg: Any) -> dict:
    return {"name": name, "arg": arg, "kind": 1}


def from_file_write(prog: dict, out: Path) -> None:
    """aten.from_file(shared=True) maps a file, view + copy_ write the batch's bytes into it."""
    target = out / "PWNED-from_file_write"
    target.write_bytes(b"original")
    x = _first_tensor_input(prog)
    _insert(prog, [
        {"target": "torch.ops.aten.from_file.default", "inputs": [
            _arg("filename", as_string=str(target)), _arg("shared", as_bool=True), _arg("size", as_int=8),
            _arg("dtype", as_scalar_type=1)], "outputs": [{"as_tensor": {"name": "evil_file"}}], "metadata": {}},
        {"target": "torch.ops.aten.view.dtype", "inputs": [_arg("self", as_tensor={"name": x}), _arg("dtype", as_scalar_type=1)],
         "outputs": [{"as_tensor": {"name": "evil_bytes"}}], "metadata": {}},
        {"target": "torch.ops.aten.copy_.default", "inputs": [_arg("self", as_tensor={"name": "evil_file"}),
                                                             _arg("src", as_tensor={"name": "evil_bytes"})],
         "outputs": [{"as_tensor": {"name": "evil_copy"}}], "metadata": {}},
    ])
    for name in ("evil_file", "evil_bytes", "evil_copy"):
        _tensor_value(prog, name, [8], 1)


def from_file_read(prog: dict, out: Path) -> None:
    _insert(prog, [{"target": "torch.ops.aten.from_file.default", "inputs": [
        _arg("filename", as_string="/etc/passwd"), _arg("shared", as_bool=False), _arg("size", as_int=64),
        _arg("dtype", as_scalar_type=1)], "outputs": [{"as_tensor": {"name": "evil_read"}}], "metadata": {}}])
    _tensor_value(prog, "evil_read", [64], 1)


def from_file_dev_zero(prog: dict, out: Path) -> None:
    _insert(prog, [{"target": "torch.ops.aten.from_file.default", "inputs": [
        _arg("filename", as_string="/dev/zero"), _arg("shared", as_bool=False), _arg("size", as_int=1 << 40),
        _arg("dtype", as_scalar_type=1)], "outputs": [{"as_tensor": {"name": "evil_zero"}}], "metadata": {}}])
    _tensor_value(prog, "evil_zero", [16], 1)


def hop_operator_system(prog: dict, out: Path) -> None:
    """A higher-order op whose argument names torch.os.system (resolved by torch's as_operator)."""
    _insert(prog, [{"target": "torch.ops.higher_order.wrap_with_set_grad_enabled", "inputs": [
        _arg("", as_bool=False), _arg("", as_operator="torch.os.system"), _arg("", as_string=f"touch {out / 'PWNED-hop'}")],
        "outputs": [{"as_tensor": {"name": "evil_hop"}}], "metadata": {}}])


def aten_operator_argument(prog: dict, out: Path) -> None:
    node = _node(prog, "aten.linear")
    node["inputs"].append(_arg("callback", as_operator="torch.builtins.eval"))


def unlisted_higher_order(prog: dict, out: Path) -> None:
    _insert(prog, [{"target": "torch.ops.higher_order.while_loop", "inputs": [], "outputs": [], "metadata": {}}])


def full_memory_bomb(prog: dict, out: Path) -> None:
    _use(prog, _full(prog, "evil_full", [1 << 20, 1 << 20]))


def declared_huge_tensor(prog: dict, out: Path) -> None:
    name = next(iter(_graph(prog)["tensor_values"]))
    _graph(prog)["tensor_values"][name]["sizes"] = [{"as_int": 1 << 31}, {"as_int": 1 << 10}]


def arange_bomb(prog: dict, out: Path) -> None:
    _use(prog, _op(prog, "arange.default", "evil_range", [10 ** 15], end={"as_float": 1e15}))


def string_argument(prog: dict, out: Path) -> None:
    node = _node(prog, "aten.gelu")
    node["inputs"] = [i for i in node["inputs"] if i["name"] != "approximate"] + [_arg("approximate", as_string="$(touch PWNED)")]


def inplace_into_input(prog: dict, out: Path) -> None:
    x = _first_tensor_input(prog)
    _insert(prog, [{"target": "torch.ops.aten.fill_.Scalar", "inputs": [_arg("self", as_tensor={"name": x}), _arg("value", as_float=7.0)],
                    "outputs": [{"as_tensor": {"name": "evil_fill"}}], "metadata": {}}])
    _tensor_value(prog, "evil_fill", [3, 4])


def out_overload(prog: dict, out: Path) -> None:
    node = _node(prog, "aten.linear")
    node["target"] = "torch.ops.aten.linear.out"


def power_tower(prog: dict, out: Path) -> None:
    _graph(prog)["sym_int_values"]["evil_sym"] = {"as_expr": {"expr_str": "9**9**9**9", "hint": None}}


def power_tower_srepr(prog: dict, out: Path) -> None:
    _graph(prog)["sym_int_values"]["evil_sym"] = {"as_expr": {"expr_str": "Pow(Integer(2), Pow(Integer(2), Integer(40)))", "hint": None}}


def float_precision_hang(prog: dict, out: Path) -> None:
    """sympy computes a Float in the precision it is given: 10**9 bits never finish (and eat memory)."""
    expr = "Mul(Float('0.1', precision=1000000000), Symbol('s0', positive=True, integer=True))"
    _graph(prog)["sym_int_values"]["evil_sym"] = {"as_expr": {"expr_str": expr, "hint": None}}


def sympify_eval(prog: dict, out: Path) -> None:
    _graph(prog)["sym_int_values"]["evil_sym"] = {"as_expr": {"expr_str": f"__import__('os').system('touch {out / 'PWNED-sympify'}')", "hint": None}}


def signature_spec_import(prog: dict, out: Path) -> None:
    """The module call graph's out_spec holds a defaultdict naming the probe (treespec_loads imports it)."""
    _write_probe(out)
    sig = prog["program"]["graph_module"]["module_call_graph"][0]["signature"]
    sig["out_spec"] = json.dumps([1, {"type": "collections.defaultdict", "context": {
        "default_factory_module": PROBE, "default_factory_name": "make", "dict_context": []}, "children_spec": []}])


def output_spec_import(prog: dict, out: Path) -> None:
    """nanreplay's own outputs.spec (read when a forward program's output is rebuilt) names the probe."""
    _write_probe(out)
    prog["outputs"] = {"spec": json.dumps([1, {"type": "collections.defaultdict", "context": {
        "default_factory_module": PROBE, "default_factory_name": "make", "dict_context": []}, "children_spec": []}]),
        "n": 0, "values": {}, "tensors": []}


def swapped_operand(prog: dict, out: Path) -> None:
    """Well formed, every operator allowed, but linear's weight is the bias: fails when run."""
    lin = _node(prog, "aten.linear")
    lin["inputs"][1]["arg"]["as_tensor"]["name"] = lin["inputs"][2]["arg"]["as_tensor"]["name"]


def loss_not_scalar(prog: dict, out: Path) -> None:
    """The loss program's output rerouted to the model's (non-scalar) activations."""
    gm = prog["program"]["graph_module"]
    name = _node(prog, "aten.gelu")["outputs"][0]["as_tensor"]["name"]
    gm["graph"]["outputs"] = [{"as_tensor": {"name": name}}]
    for spec in gm["signature"]["output_specs"]:
        if "user_output" in spec:
            spec["user_output"]["arg"] = {"as_tensor": {"name": name}}


def damaged_node_inputs(prog: dict, out: Path) -> None:
    _graph(prog)["nodes"][1]["inputs"] = {"not": "a list"}


def damaged_argument_union(prog: dict, out: Path) -> None:
    _graph(prog)["nodes"][1]["inputs"][0]["arg"] = {"as_tensor": {"name": "x"}, "as_int": 3}


def damaged_state_entry(prog: dict, out: Path) -> None:
    name = next(iter(prog["state"]))
    del prog["state"][name]["kind"]


# -- attacks on memory: views, kernels' indices, sizes, bytes alive, work (issue 32) ---------------
#
# Each builds its nodes with ``_op`` and makes the loss depend on them (``_use``): a node nothing
# uses is dropped by torch's deserializer, and would prove nothing. Every tensor is declared with
# the size its op computes (metadata that lies is refused as damage, exit 4, before anything else).

FLOAT, LONG = 7, 5
BIG_MIB = 1 << 18  # float32 elements in 1 MiB


def _t(name: str) -> dict:
    return {"as_tensor": {"name": name}}


def _op(prog: dict, target: str, out: str, sizes: list[int], dtype: int = FLOAT, **inputs: dict) -> str:
    """Append a node ``out = aten.<target>(**inputs)`` declared as ``sizes`` of ``dtype`` (an input
    named ``name_`` is the keyword-only argument ``name``)."""
    args = [dict(_arg(k.rstrip("_"), **v), kind=2 if k.endswith("_") else 1) for k, v in inputs.items()]  # name_: keyword-only
    _graph(prog)["nodes"].append({"target": f"torch.ops.aten.{target}", "inputs": args,
                                  "outputs": [{"as_tensor": {"name": out}}], "metadata": _root_meta(prog)})
    _tensor_value(prog, out, sizes, dtype)
    return out


def _use(prog: dict, *names: str) -> None:
    """The loss becomes ``loss + 0 * sum(name)`` for each name: the program's result depends on them."""
    g = _graph(prog)
    loss = g["outputs"][0]["as_tensor"]["name"]
    for name in names:
        total = _op(prog, "sum.default", f"{name}_sum", [], FLOAT, self=_t(name))
        zero = _op(prog, "mul.Scalar", f"{name}_zero", [], FLOAT, self=_t(total), other={"as_float": 0.0})
        loss = _op(prog, "add.Tensor", f"{name}_loss", [], FLOAT, self=_t(g["outputs"][0]["as_tensor"]["name"]), other=_t(zero))
        g["outputs"] = [_t(loss)]
    for spec in prog["program"]["graph_module"]["signature"]["output_specs"]:
        if "user_output" in spec:
            spec["user_output"]["arg"] = _t(loss)


def _full(prog: dict, out: str, sizes: list[int], value: float = 1.0, dtype: int = FLOAT) -> str:
    fill = {"as_int": int(value)} if dtype == LONG else {"as_float": value}
    return _op(prog, "full.default", out, sizes, dtype, size={"as_ints": sizes}, fill_value=fill, dtype_={"as_scalar_type": dtype})


def reshape_alias_read(prog: dict, out: Path) -> None:
    """``_reshape_alias`` spreads the batch's 12 floats 4,096 apart: a read of 180 KiB of the heap
    after them (torch's fake kernel is a checked ``view``: only its own kernel shows the strides)."""
    x = _first_tensor_input(prog)
    flat = _op(prog, "reshape.default", "evil_flat", [12], self=_t(x), shape={"as_ints": [12]})
    _use(prog, _op(prog, "_reshape_alias.default", "evil_view", [12], self=_t(flat), size={"as_ints": [12]}, stride={"as_ints": [1 << 12]}))


def reshape_alias_write(prog: dict, out: Path) -> None:
    """... and ``fill_`` writes through such a view of a tensor the program made (glibc aborted)."""
    made = _full(prog, "evil_small", [4])
    view = _op(prog, "_reshape_alias.default", "evil_view", [4], self=_t(made), size={"as_ints": [4]}, stride={"as_ints": [1 << 14]})
    _use(prog, _op(prog, "fill_.Scalar", "evil_fill", [4], self=_t(view), value={"as_float": 7.0}))


def select_far(prog: dict, out: Path) -> None:
    """A view op of the allowlist with a crafted index: ``select`` of row 2**40 of the batch."""
    x = _first_tensor_input(prog)
    _use(prog, _op(prog, "select.int", "evil_row", [4], self=_t(x), dim={"as_int": 0}, index={"as_int": 1 << 40}))


def narrow_far(prog: dict, out: Path) -> None:
    x = _first_tensor_input(prog)
    _use(prog, _op(prog, "narrow.default", "evil_narrow", [3, 1 << 20], self=_t(x), dim={"as_int": 1}, start={"as_int": 2},
                   length={"as_int": 1 << 20}))


def ctc_target_huge(prog: dict, out: Path) -> None:
    """``ctc_loss`` with a target class of 2**40 (segfaulted replay)."""
    x = _first_tensor_input(prog)
    x3 = _op(prog, "unsqueeze.default", "evil_x3", [3, 1, 4], self=_t(x), dim={"as_int": 1})
    lp = _op(prog, "log_softmax.int", "evil_lp", [3, 1, 4], self=_t(x3), dim={"as_int": -1})
    targets = _full(prog, "evil_targets", [1, 2], 1 << 40, LONG)
    _use(prog, _op(prog, "ctc_loss.IntList", "evil_ctc", [], FLOAT, log_probs=_t(lp), targets=_t(targets), input_lengths={"as_ints": [3]},
                   target_lengths={"as_ints": [2]}))


def embedding_bag_negative_offset(prog: dict, out: Path) -> None:
    """``embedding_bag`` whose offsets start at -8 (read before its buffer, printed 8 heap bytes)."""
    w = prog["program"]["graph_module"]["signature"]["input_specs"][0]["parameter"]["arg"]["name"]
    idx = _full(prog, "evil_idx", [4], 0, LONG)
    off = _full(prog, "evil_off", [2], -8, LONG)
    bag = _op(prog, "embedding_bag.default", "evil_bag", [2, 4], weight=_t(w), indices=_t(idx), offsets=_t(off))
    _graph(prog)["nodes"][-1]["outputs"] = [_t("evil_bag"), _t("evil_bag_o2b"), _t("evil_bag_size"), _t("evil_bag_max")]
    for name in ("evil_bag_o2b", "evil_bag_size", "evil_bag_max"):
        _tensor_value(prog, name, [4] if name == "evil_bag_o2b" else [2], LONG)
    _use(prog, bag)


def gather_out_of_range(prog: dict, out: Path) -> None:
    x = _first_tensor_input(prog)
    idx = _full(prog, "evil_index", [3, 4], 1 << 20, LONG)
    _use(prog, _op(prog, "gather.default", "evil_gather", [3, 4], self=_t(x), dim={"as_int": 1}, index=_t(idx)))


def index_select_out_of_range(prog: dict, out: Path) -> None:
    x = _first_tensor_input(prog)
    idx = _full(prog, "evil_index", [2], -5, LONG)
    _use(prog, _op(prog, "index_select.default", "evil_select", [3, 2], self=_t(x), dim={"as_int": 1}, index=_t(idx)))


def full_2gib(prog: dict, out: Path) -> None:
    """A 2 GiB ``full`` (ran with 2.4 GiB of memory when a declared entry raised the limit)."""
    _use(prog, _full(prog, "evil_full", [1 << 29]))


def declared_extra_input(prog: dict, out: Path) -> None:
    """An extra ``inputs.tensor_meta`` entry matching no input, sized to raise a limit, and the 2 GiB ``full``."""
    prog["inputs"]["tensor_meta"].append({"dtype": "float32", "shape": [1 << 23, 1 << 23]})
    full_2gib(prog, out)


def declared_input_shape(prog: dict, out: Path) -> None:
    """The declared input shape differs from the recorded batch's."""
    prog["inputs"]["tensor_meta"][0]["shape"] = [None, 1 << 20]


def empty_strided_bytes(prog: dict, out: Path) -> None:
    """``empty_strided`` of 262,144 elements with a row stride of 2**21: 2 GiB of storage."""
    _use(prog, _op(prog, "empty_strided.default", "evil_strided", [256, 1024], size={"as_ints": [256, 1024]},
                   stride={"as_ints": [1 << 21, 1]}, dtype_={"as_scalar_type": FLOAT}))


def kept_alive_slices(prog: dict, out: Path) -> None:
    """Eight 128 MiB tensors, each kept alive by a 1-element slice until the end: 1 GiB."""
    slices = []
    for i in range(8):
        big = _full(prog, f"evil_big{i}", [128 * BIG_MIB])
        slices.append(_op(prog, "slice.Tensor", f"evil_slice{i}", [1], self=_t(big), dim={"as_int": 0}, start={"as_int": 0},
                          end={"as_int": 1}))
    _use(prog, *slices)


def conv1d_workspace(prog: dict, out: Path) -> None:
    """``conv1d`` of a 2**17 signal with a 2**16 kernel: 768 KiB of tensors, a 16 GiB im2col workspace."""
    x = _full(prog, "evil_signal", [1, 1, 1 << 17])
    w = _full(prog, "evil_kernel", [1, 1, 1 << 16])
    _use(prog, _op(prog, "conv1d.default", "evil_conv", [1, 1, (1 << 16) + 1], input=_t(x), weight=_t(w)))


def matmul_storm(prog: dict, out: Path) -> None:
    """Forty 2048 x 2048 matrix products (a bundle of kilobytes asking for minutes of CPU)."""
    a = _full(prog, "evil_a", [2048, 2048])
    for i in range(40):
        a = _op(prog, "mm.default", f"evil_mm{i}", [2048, 2048], self=_t(a), mat2=_t("evil_a"))
    _use(prog, a)


def attention_value_short(prog: dict, out: Path) -> None:
    """``scaled_dot_product_attention`` with a key of 4,096 positions and a value of 4: its CPU
    kernel reads 4,092 rows past the value (found probing allowlisted ops; torch does not check)."""
    q = _full(prog, "evil_q", [1, 1, 4, 8])
    k = _full(prog, "evil_k", [1, 1, 4096, 8])
    v = _full(prog, "evil_v", [1, 1, 4, 8])
    _use(prog, _op(prog, "scaled_dot_product_attention.default", "evil_attn", [1, 1, 4, 8], query=_t(q), key=_t(k), value=_t(v)))


def batch_norm_short_stats(prog: dict, out: Path) -> None:
    """``native_batch_norm`` in eval mode with one running mean and variance for 4 channels: its CPU
    kernel reads three past each (the composite ``batch_norm`` that export emits checks them)."""
    x = _first_tensor_input(prog)
    mean, var = _full(prog, "evil_mean", [1], 0.0), _full(prog, "evil_var", [1])
    _op(prog, "native_batch_norm.default", "evil_bn", [3, 4], input=_t(x), weight={"as_none": True}, bias={"as_none": True},
        running_mean=_t(mean), running_var=_t(var), training={"as_bool": False}, momentum={"as_float": 0.1}, eps={"as_float": 1e-5})
    _graph(prog)["nodes"][-1]["outputs"] = [_t("evil_bn"), _t("evil_bn_mean"), _t("evil_bn_rstd")]
    _use(prog, "evil_bn")


def empty_heap_read(prog: dict, out: Path) -> None:
    """``empty`` of 4 MiB, summed into the loss: uninitialized memory holds the heap's old bytes."""
    _use(prog, _op(prog, "empty.memory_format", "evil_empty", [1 << 20], size={"as_ints": [1 << 20]}))


def inplace_through_detach(prog: dict, out: Path) -> None:
    """``fill_`` into ``detach`` of the batch: an alias of the recorded input."""
    x = _first_tensor_input(prog)
    d = _op(prog, "detach.default", "evil_detached", [3, 4], self=_t(x))
    _use(prog, _op(prog, "fill_.Scalar", "evil_fill", [3, 4], self=_t(d), value={"as_float": 7.0}))


def inplace_through_weight_view(prog: dict, out: Path) -> None:
    """``mul_`` into a view of ``detach`` of a weight (autograd does not object to a detached alias)."""
    w = prog["program"]["graph_module"]["signature"]["input_specs"][0]["parameter"]["arg"]["name"]
    d = _op(prog, "detach.default", "evil_wdetached", [3, 4], self=_t(w))
    v = _op(prog, "view.default", "evil_wview", [12], self=_t(d), size={"as_ints": [12]})
    _use(prog, _op(prog, "mul_.Scalar", "evil_mul", [12], self=_t(v), other={"as_float": 0.0}))


def inplace_through_to(prog: dict, out: Path) -> None:
    """``add_`` into ``to(float32)`` of the float32 batch: a conversion that copies nothing."""
    x = _first_tensor_input(prog)
    t = _op(prog, "to.dtype", "evil_to", [3, 4], self=_t(x), dtype_={"as_scalar_type": FLOAT})
    _use(prog, _op(prog, "add_.Scalar", "evil_add", [3, 4], self=_t(t), other={"as_float": 1.0}))


def _write_probe(out: Path) -> None:
    (out / f"{PROBE}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(out / 'PWNED-probe')!r}).touch()\n"
        "def make():\n    return 0\n"
    )


REFUSED = "allowlist"
ATTACKS: list[ProgramAttack] = [
    ProgramAttack("from_file_write", "aten.from_file(shared=True) + copy_: writes the batch's bytes into a file", from_file_write, 5, "aten.from_file"),
    ProgramAttack("from_file_read", "aten.from_file(shared=False) reads /etc/passwd into the computation", from_file_read, 5, "aten.from_file"),
    ProgramAttack("from_file_dev_zero", "aten.from_file of /dev/zero with a 1 TiB size: a memory bomb", from_file_dev_zero, 5, "aten.from_file"),
    ProgramAttack("hop_operator_system", "a higher-order op whose argument names torch.os.system", hop_operator_system, 5, "operator passed as a value"),
    ProgramAttack("aten_operator_argument", "an aten op given torch.builtins.eval as an extra argument", aten_operator_argument, 5, "operator passed as a value"),
    ProgramAttack("unlisted_higher_order", "torch.ops.higher_order.while_loop (unbounded work)", unlisted_higher_order, 5, "higher-order operator not on the allowlist"),
    ProgramAttack("full_memory_bomb", "aten.full of 2**40 elements", full_memory_bomb, 5, "more than the program's budget", bounded=True),
    ProgramAttack("declared_huge_tensor", "a weight declared with 2**41 elements", declared_huge_tensor, 4, "contradicts its own ops"),
    ProgramAttack("arange_bomb", "aten.arange(1e15)", arange_bomb, 5, "more than the program's budget", bounded=True),
    ProgramAttack("string_argument", "gelu's approximate set to a shell command", string_argument, 5, "not one of the values allowed"),
    ProgramAttack("inplace_into_input", "fill_ into the recorded batch", inplace_into_input, 5, "writes in place into the call's input 0"),
    ProgramAttack("out_overload", "aten.linear.out instead of .default", out_overload, 5, REFUSED),
    ProgramAttack("power_tower", "the symbolic size 9**9**9**9 (kept replay at 100% CPU forever)", power_tower, 4, "symbolic size expression", 4),
    ProgramAttack("power_tower_srepr", "Pow(2, Pow(2, 40)) in srepr form (exhausted memory)", power_tower_srepr, 4, "symbolic size expression", 4),
    ProgramAttack("float_precision_hang", "a Float of 10**9 bits of precision in a symbolic size (hung replay)", float_precision_hang, 4,
                  "symbolic size expression", 4),
    ProgramAttack("sympify_eval", "an expression that sympify would evaluate as Python", sympify_eval, 4, "symbolic size expression", 4),
    ProgramAttack("signature_spec_import", "the module call graph's out_spec: a defaultdict naming a module", signature_spec_import, 4, "tree of tuples, lists and dicts", 4),
    ProgramAttack("output_spec_import", "outputs.spec: a defaultdict naming a module (decoded by nanreplay: never imported)", output_spec_import, 0, "reproduced exactly"),
    ProgramAttack("swapped_operand", "a valid, allowed program that cannot run (a weight swapped for a bias)", swapped_operand, 5,
                  "failed while running on fake tensors"),
    ProgramAttack("loss_not_scalar", "a loss program whose output is not a scalar", loss_not_scalar, 5, "expected a floating scalar"),
    ProgramAttack("damaged_node_inputs", "a node's inputs replaced by an object", damaged_node_inputs, 4, ".inputs", 4),
    ProgramAttack("damaged_argument_union", "an argument with two kinds", damaged_argument_union, 4, "Argument union", 4),
    ProgramAttack("damaged_state_entry", "a state entry without its kind", damaged_state_entry, 4, "meta.program.state", 4),
    # issue 32: memory. Views with crafted geometry, kernels' indices, declared sizes, bytes alive, work, aliases
    ProgramAttack("reshape_alias_read", "aten._reshape_alias spreads the batch's 12 floats 4,096 apart: reads the heap", reshape_alias_read, 5,
                  "is not on the operator allowlist", bounded=True),
    ProgramAttack("reshape_alias_write", "fill_ through an aten._reshape_alias view with a stride of 16,384", reshape_alias_write, 5,
                  "is not on the operator allowlist", bounded=True),
    ProgramAttack("select_far", "aten.select of row 2**40 of a 3-row batch", select_far, 5, "failed while running on fake tensors", bounded=True),
    ProgramAttack("narrow_far", "aten.narrow of 2**20 columns of a 4-column batch", narrow_far, 5, "failed while running on fake tensors",
                  bounded=True),
    ProgramAttack("ctc_target_huge", "ctc_loss with a target class of 2**40 (segfaulted; torch has no fake kernel for it)", ctc_target_huge, 5,
                  "(aten.ctc_loss.IntList) failed while running on fake tensors", bounded=True),
    ProgramAttack("embedding_bag_negative_offset", "embedding_bag whose offsets are -8 (read before its buffer)", embedding_bag_negative_offset,
                  5, "takes 'offsets' from -8", bounded=True),
    ProgramAttack("gather_out_of_range", "gather at column 2**20 of a 4-column batch", gather_out_of_range, 5,
                  "indexes with 'index' values from 1,048,576", bounded=True),
    ProgramAttack("index_select_out_of_range", "index_select of column -5", index_select_out_of_range, 5, "values from -5 to -5, outside [0, 4)",
                  bounded=True),
    ProgramAttack("full_2gib", "a 2 GiB aten.full from a bundle of kilobytes", full_2gib, 5, "would hold 2.00 GiB of storages alive", bounded=True),
    ProgramAttack("declared_extra_input", "an extra declared input of 2**46 elements, and the 2 GiB full", declared_extra_input, 4,
                  "one entry per tensor leaf", 4, bounded=True),
    ProgramAttack("declared_input_shape", "the declared input shape differs from the recorded batch", declared_input_shape, 4,
                  "declared inputs (meta.program.inputs) do not match", bounded=True),
    ProgramAttack("empty_strided_bytes", "empty_strided of 262,144 elements and 2 GiB of storage", empty_strided_bytes, 5,
                  "would hold 1.99 GiB of storages alive", bounded=True),
    ProgramAttack("kept_alive_slices", "eight 128 MiB tensors kept alive by 1-element slices", kept_alive_slices, 5,
                  "of storages alive, more than the program's budget", bounded=True),
    ProgramAttack("conv1d_workspace", "conv1d with a 2**16 kernel: a 16 GiB im2col workspace", conv1d_workspace, 5, "and a workspace of 16.00 GiB",
                  bounded=True),
    ProgramAttack("matmul_storm", "forty 2048 x 2048 matrix products", matmul_storm, 5, "element-operations, more than its budget", bounded=True),
    ProgramAttack("attention_value_short", "scaled_dot_product_attention with a value 1,024 times shorter than its key", attention_value_short, 5,
                  "and a value [1, 1, 4, 8] of different lengths", bounded=True),
    ProgramAttack("batch_norm_short_stats", "native_batch_norm with one running statistic for four channels", batch_norm_short_stats, 5,
                  "is not on the operator allowlist", bounded=True),
    ProgramAttack("empty_heap_read", "aten.empty of 4 MiB summed into the loss: the heap's old bytes (filled with NaN instead)", empty_heap_read,
                  0, "reproduced exactly", bounded=True),
    ProgramAttack("inplace_through_detach", "fill_ into detach() of the batch", inplace_through_detach, 5, "writes in place into the call's input 0",
                  bounded=True),
    ProgramAttack("inplace_through_weight_view", "mul_ into a view of a weight", inplace_through_weight_view, 5,
                  "writes in place into the parameter 'fc.weight'", bounded=True),
    ProgramAttack("inplace_through_to", "add_ into a no-copy to(float32) of the batch", inplace_through_to, 5,
                  "writes in place into the call's input 0", bounded=True),
]


def build_all(out: Path) -> dict[str, Path]:
    """Record the base bundle (untrusted) and write every attack into ``out``: name -> file."""
    from nanreplay import untrust_bundle

    out.mkdir(parents=True, exist_ok=True)
    base = record_base(out / "program-base")
    untrust_bundle(base)
    manifest = read_manifest(base)
    assert manifest["meta"]["program"]["kind"] == "loss", manifest["meta"]["program"].get("error")
    files = {}
    for attack in ATTACKS:
        path = out / f"program-{attack.name}{base.suffix}"
        path.write_bytes(base.read_bytes())
        m = copy.deepcopy(manifest)
        attack.edit(m["meta"]["program"], out)
        write_manifest(path, m)
        files[attack.name] = path
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[-1])
        return 2
    out = Path(argv[0])
    files = build_all(out)
    index = {a.name: {"file": files[a.name].name, "what": a.what, "replay_exit": a.exit, "says": a.says, "inspect_exit": a.inspect}
             for a in ATTACKS}
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {len(files)} program attack files and index.json to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

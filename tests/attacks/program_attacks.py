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


def _insert(prog: dict, nodes: list[dict]) -> None:
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
    _insert(prog, [{"target": "torch.ops.aten.full.default", "inputs": [
        _arg("size", as_ints=[1 << 20, 1 << 20]), _arg("fill_value", as_float=1.0)],
        "outputs": [{"as_tensor": {"name": "evil_full"}}], "metadata": {}}])
    _tensor_value(prog, "evil_full", [4])


def declared_huge_tensor(prog: dict, out: Path) -> None:
    name = next(iter(_graph(prog)["tensor_values"]))
    _graph(prog)["tensor_values"][name]["sizes"] = [{"as_int": 1 << 31}, {"as_int": 1 << 10}]


def arange_bomb(prog: dict, out: Path) -> None:
    _insert(prog, [{"target": "torch.ops.aten.arange.default", "inputs": [_arg("end", as_float=1e15)],
                    "outputs": [{"as_tensor": {"name": "evil_range"}}], "metadata": {}}])
    _tensor_value(prog, "evil_range", [4])


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
    ProgramAttack("full_memory_bomb", "aten.full of 2**40 elements", full_memory_bomb, 5, "more than the bundle's tensors justify"),
    ProgramAttack("declared_huge_tensor", "a tensor declared with 2**41 elements", declared_huge_tensor, 5, "more than the bundle's tensors justify"),
    ProgramAttack("arange_bomb", "aten.arange(1e15)", arange_bomb, 5, "more than the bundle's tensors justify"),
    ProgramAttack("string_argument", "gelu's approximate set to a shell command", string_argument, 5, "not one of the values allowed"),
    ProgramAttack("inplace_into_input", "fill_ into the recorded batch", inplace_into_input, 5, "writes in place"),
    ProgramAttack("out_overload", "aten.linear.out instead of .default", out_overload, 5, REFUSED),
    ProgramAttack("power_tower", "the symbolic size 9**9**9**9 (kept replay at 100% CPU forever)", power_tower, 4, "symbolic size expression", 4),
    ProgramAttack("power_tower_srepr", "Pow(2, Pow(2, 40)) in srepr form (exhausted memory)", power_tower_srepr, 4, "symbolic size expression", 4),
    ProgramAttack("float_precision_hang", "a Float of 10**9 bits of precision in a symbolic size (hung replay)", float_precision_hang, 4,
                  "symbolic size expression", 4),
    ProgramAttack("sympify_eval", "an expression that sympify would evaluate as Python", sympify_eval, 4, "symbolic size expression", 4),
    ProgramAttack("signature_spec_import", "the module call graph's out_spec: a defaultdict naming a module", signature_spec_import, 4, "tree of tuples, lists and dicts", 4),
    ProgramAttack("output_spec_import", "outputs.spec: a defaultdict naming a module (decoded by nanreplay: never imported)", output_spec_import, 0, "reproduced exactly"),
    ProgramAttack("swapped_operand", "a valid, allowed program that cannot run (a weight swapped for a bias)", swapped_operand, 5, "failed while running"),
    ProgramAttack("loss_not_scalar", "a loss program whose output is not a scalar", loss_not_scalar, 5, "expected a floating scalar"),
    ProgramAttack("damaged_node_inputs", "a node's inputs replaced by an object", damaged_node_inputs, 4, ".inputs", 4),
    ProgramAttack("damaged_argument_union", "an argument with two kinds", damaged_argument_union, 4, "Argument union", 4),
    ProgramAttack("damaged_state_entry", "a state entry without its kind", damaged_state_entry, 4, "meta.program.state", 4),
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

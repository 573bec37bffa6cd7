"""The verifier (nanreplay.engine.bounds), on graphs exported or traced here: genuine programs are
proven (with the right peak of bytes alive: temporaries die, views keep their base, workspaces
count), and every limit refuses with its node, op and numbers before anything real runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanreplay.engine.bounds import BYTES_ALLOWANCE, BYTES_FACTOR, WORK_ALLOWANCE, WORK_FACTOR, Budget, verify_bounds
from nanreplay.engine.program_check import ProgramRefused
from nanreplay.errors import BundleFormatError

MIB = 1 << 20


def _inputs(ep, args):
    """verify_bounds's arguments for an ExportedProgram called on ``args``."""
    inputs, names, writable, user = [], [], [], []
    it = iter(args)
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            user.append(len(inputs))
            inputs.append(next(it))
            names.append(f"the call's input {len(user) - 1}")
            continue
        t = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
        if kind == "BUFFER":
            writable.append(len(inputs))
        names.append(f"the {kind.lower()} {spec.target!r}")
        inputs.append(t)
    return inputs, dict(names=names, writable=writable, user=user)


def prove(module: torch.nn.Module, *args: torch.Tensor, exact: bool = True):
    ep = torch.export.export(module, args)
    inputs, kw = _inputs(ep, args)
    return verify_bounds(ep.graph_module, inputs, exact=exact, **kw)


def prove_traced(fn, *args: torch.Tensor):
    """A plain fx trace of ``fn`` (aten ops called directly stay as they are)."""
    gm = torch.fx.symbolic_trace(fn)
    return verify_bounds(gm, list(args), names=[f"the call's input {i}" for i in range(len(args))], writable=[], user=range(len(args)),
                         exact=True)


class Fn(torch.nn.Module):
    def __init__(self, fn, **params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_parameter(k, torch.nn.Parameter(v))

    def forward(self, *args):
        return self.fn(self, *args)


def test_the_budget_comes_from_the_real_tensors_only():
    w, x = torch.ones(10), torch.ones(5)
    b = Budget.of([w, w, w[:2]], [x])  # a tied weight and a view of it: one storage
    assert (b.real_bytes, b.real_elements, b.input_elements) == (60, 27, 5)
    assert b.bytes == BYTES_FACTOR * 60 + BYTES_ALLOWANCE and b.work == WORK_FACTOR * 27 * 5 + WORK_ALLOWANCE


def test_a_genuine_program_is_proven_and_no_random_generator_moves():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 2)).train()
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,))
    inputs, kw = _inputs(ep, (x,))
    state = torch.get_rng_state()
    proof = verify_bounds(ep.graph_module, inputs, **kw)
    assert torch.equal(state, torch.get_rng_state())
    assert proof.nodes >= 6 and 0 < proof.peak_bytes <= proof.budget.bytes and 0 < proof.work <= proof.budget.work


def test_temporaries_die_after_their_last_use_and_slices_keep_their_base_alive():
    n = 1 << 20  # 4 MiB each

    def temporaries(m, x):
        for _ in range(6):
            x = x + torch.ones(n).sum()
        return x

    def slices(m, x):
        parts = [torch.ones(n)[:1] for _ in range(6)]
        return x + sum(parts)

    short = prove(Fn(temporaries), torch.ones(1))
    kept = prove(Fn(slices), torch.ones(1))
    assert 4 * MIB <= short.peak_bytes < 2 * 4 * MIB
    assert kept.peak_bytes >= 6 * 4 * MIB


def test_bytes_over_the_budget_are_refused_with_the_node_and_the_numbers():
    with pytest.raises(ProgramRefused) as e:
        prove(Fn(lambda m, x: x + torch.ones(1 << 27).sum()), torch.ones(1))
    msg = str(e.value)
    assert "node 'ones' (aten.ones.default) would hold 512.0 MiB of storages alive, more than the program's budget of 256.0 MiB" in msg
    assert "trust=True" in msg and "--trust" in e.value.describe(cli=True)


def test_a_large_stride_counts_the_storage_it_spans():
    with pytest.raises(ProgramRefused, match=r"would hold 1\.99 GiB of storages alive"):
        prove(Fn(lambda m, x: x + torch.empty_strided((256, 1024), (1 << 21, 1)).sum()), torch.ones(1))


def test_a_convolution_counts_its_unfolded_input():
    small = prove(Fn(lambda m, x: F.conv1d(x, m.w), w=torch.ones(1, 1, 2048)), torch.ones(1, 1, 4096))
    assert small.peak_bytes >= 2048 * 2049 * 4  # the im2col workspace, far above the 8 KiB output
    with pytest.raises(ProgramRefused, match=r"and a workspace of 1\.00 GiB"):
        prove(Fn(lambda m, x: F.conv1d(x, m.w), w=torch.ones(1, 1, 1 << 14)), torch.ones(1, 1, 1 << 15))


def test_work_over_the_budget_is_refused():
    def storm(m, x):
        a = torch.ones(2048, 2048)
        for _ in range(3):
            a = a @ a
        return x + a.sum()

    with pytest.raises(ProgramRefused, match=r"running aten\.mm\.default\) would bring the program's work to [0-9,]+ element-operations"):
        prove(Fn(storm), torch.ones(1))


def test_a_view_outside_its_storage_is_refused_by_its_own_kernel():
    """torch's fake ``_reshape_alias`` is a checked view (stride 1); its real kernel keeps 4096."""
    with pytest.raises(ProgramRefused, match=r"makes a view \(in its own kernel\) with sizes \[12\], strides \[4096\]"):
        prove_traced(lambda x: torch.ops.aten._reshape_alias.default(x, [12], [4096]).sum(), torch.ones(12))
    assert prove_traced(lambda x: torch.ops.aten._reshape_alias.default(x, [3, 4], [4, 1]).sum(), torch.ones(12)).nodes >= 3


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)  # a buffer: allowed
        return self.lin(x)


@pytest.mark.parametrize("fn, who", [
    (lambda m, x: x.detach().mul_(2) + m.lin(x), "the call's input 0"),
    (lambda m, x: m.lin(x) + m.lin.weight.detach()[0:1].fill_(0).sum(), "the parameter 'lin.weight'"),
    (lambda m, x: m.lin(x + x.to(torch.float32).add_(1)), "the call's input 0"),
])
def test_an_in_place_write_through_an_alias_of_a_real_tensor_is_refused(fn, who):
    assert prove(_Counter(), torch.ones(2, 4)).nodes > 0

    class M(_Counter):
        def forward(self, x):
            return fn(self, x)

    with pytest.raises(ProgramRefused, match=f"writes in place into {who}"):
        prove(M(), torch.ones(2, 4))


def test_the_subgraphs_of_higher_order_ops_are_followed_and_named():
    def regions(m, x):
        with torch.no_grad():
            y = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = m.lin(y)
        return z.float().sum()

    m = Fn(regions)
    m.lin = torch.nn.Linear(4, 4)
    ep = torch.export.export(m, (torch.ones(2, 4),))
    kinds = {str(n.target) for n in ep.graph_module.graph.nodes}
    assert any("wrap_with_set_grad_enabled" in k for k in kinds) and any("wrap_with_autocast" in k for k in kinds), kinds
    assert prove(m, torch.ones(2, 4)).nodes > len(ep.graph_module.graph.nodes)  # the subgraphs' nodes counted

    def big_inside(m, x):
        with torch.no_grad():
            y = torch.ones(1 << 27)
        return x + y.sum()

    with pytest.raises(ProgramRefused, match=r"node 'ones' \(aten\.ones\.default\) would hold 512\.0 MiB"):
        prove(Fn(big_inside), torch.ones(1))


def test_a_size_that_depends_on_values_counts_at_its_bound_or_is_refused():
    proof = prove_traced(lambda x: torch.ops.aten.nonzero.default(x).sum(), torch.ones(64, 64))
    assert proof.peak_bytes >= 64 * 64 * 2 * 8  # nonzero's output at its upper bound: every element, int64 pairs
    with pytest.raises(ProgramRefused, match="bincount"):
        prove_traced(lambda x: torch.ops.aten.bincount.default(x).sum(), torch.tensor([1, 2]))
    with pytest.raises(ProgramRefused, match="repeat_interleave"):
        prove_traced(lambda x: torch.ops.aten.repeat_interleave.Tensor(x).sum(), torch.tensor([1, 2]))


def test_a_declared_size_that_differs_from_the_computed_one_is_damage():
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = torch.nn.Linear(4, 3)
    ep = torch.export.export(m, (torch.ones(2, 4),))
    node = next(n for n in ep.graph_module.graph.nodes if n.op == "call_function")
    node.meta["val"] = FakeTensorMode().from_tensor(torch.empty(7, 7))
    inputs, kw = _inputs(ep, (torch.ones(2, 4),))
    with pytest.raises(BundleFormatError, match=r"is declared as \[7, 7\] \(None: symbolic\) but computes \[2, 3\]"):
        verify_bounds(ep.graph_module, inputs, **kw)
    real = next(n for n in ep.graph_module.graph.nodes if n.op == "placeholder" and "weight" in n.name)
    node.meta["val"] = FakeTensorMode().from_tensor(torch.empty(2, 3))
    real.meta["val"] = FakeTensorMode().from_tensor(torch.empty(1 << 20, 4))  # a weight declared larger than the real one
    with pytest.raises(BundleFormatError, match=r"declared as \[1048576, 4\]"):
        verify_bounds(ep.graph_module, inputs, **kw)


def test_a_factorisation_counts_its_cubic_work():
    with pytest.raises(ProgramRefused, match=r"running aten\._linalg_svd\.default\) would bring the program's work"):
        prove(Fn(lambda m, x: x + torch.linalg.svdvals(torch.ones(2048, 2048)).sum()), torch.ones(1))


def test_an_attention_with_a_value_shorter_than_its_key_is_refused_before_its_kernel_reads_past_it():
    q, k, v = torch.ones(1, 2, 4, 8), torch.ones(1, 2, 9, 8), torch.ones(1, 2, 4, 8)
    with pytest.raises(ProgramRefused, match=r"takes a key \[1, 2, 9, 8\] and a value \[1, 2, 4, 8\] of different lengths"):
        prove_traced(lambda q, k, v: torch.ops.aten.scaled_dot_product_attention.default(q, k, v), q, k, v)
    assert prove_traced(lambda q, k, v: torch.ops.aten.scaled_dot_product_attention.default(q, k, v), q, k, k).nodes > 0


@pytest.mark.parametrize("fn, count", [
    (lambda x: torch.ops.aten.tensor_split.sections(x, 1 << 31), "2,147,483,648"),  # one slice object each, even empty
    (lambda x: torch.ops.aten.unbind.int(x.new_empty(1 << 40, 0)), "1,099,511,627,776"),  # no bytes, 2**40 rows
    (lambda x: torch.ops.aten.split.Tensor(x.new_empty(1 << 30, 0), 1), "1,073,741,824"),
    (lambda x: torch.ops.aten.chunk.default(x.new_empty(0), 1 << 31), "2,147,483,648"),  # an empty dimension: that many chunks
])
def test_an_op_that_would_return_millions_of_tensors_is_refused_before_it_runs(fn, count):
    """A list of tensors costs memory per tensor even when each holds no element: an op's count of
    outputs is bounded from its arguments before the node runs (the verifier itself ran out of
    memory on tensor_split with 2**31 sections in the argument fuzzer)."""
    with pytest.raises(ProgramRefused, match=f"would return {count} tensors; at most 65,536 are allowed"):
        prove_traced(lambda x: fn(x)[0] + 1, torch.ones(4))


def test_an_op_returning_as_many_tensors_as_declared_is_proven():
    m = Fn(lambda m, x: torch.stack([t.sum() for t in x.split(2)] + [x.unbind(0)[0].sum()] + [c.sum() for c in x.chunk(3)]))
    ep = torch.export.export(m, (torch.ones(6, 3),))
    listed = {str(n.target) for n in ep.graph_module.graph.nodes if isinstance(n.meta.get("val"), (list, tuple))}
    assert {"aten.split.Tensor", "aten.unbind.int"} <= listed  # the nodes declare their lists of outputs
    inputs, kw = _inputs(ep, (torch.ones(6, 3),))
    assert verify_bounds(ep.graph_module, inputs, exact=True, **kw).peak_bytes > 0


def test_the_output_counts_follow_each_overload():
    from nanreplay.engine.bounds import OUTPUT_COUNTS, op_arguments

    x = torch.empty(10, 3)
    for op, args in [(torch.ops.aten.split.Tensor, (x, 3)), (torch.ops.aten.split.sizes, (x, [4, 6])),
                     (torch.ops.aten.tensor_split.sections, (x, 4)), (torch.ops.aten.tensor_split.indices, (x, [2, 5, 7])),
                     (torch.ops.aten.chunk.default, (x, 4)), (torch.ops.aten.unbind.int, (x,))]:
        assert OUTPUT_COUNTS[op.overloadpacket.__name__](op_arguments(op, args, {})) == len(op(*args)), op

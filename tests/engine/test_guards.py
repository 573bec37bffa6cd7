"""The run-time index guard (nanreplay.engine.guards): every allowlisted op that indexes with tensor
values reaches a row of INDEX_CHECKS; genuine indices pass with the kernel's own results; values out
of range are refused before the kernel runs, naming the argument and the range, never crashing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nanreplay.engine import opset
from nanreplay.engine.guards import INDEX_CHECKS, IndexGuard
from nanreplay.engine.program_check import ProgramRefused

pytestmark = pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")  # scatter.reduce is deprecated, still allowlisted

X = torch.arange(12.0).reshape(3, 4)
L = torch.long

#: allowlisted op -> a genuine call of it (its index arguments in range)
EXAMPLES = {
    "embedding.default": lambda: F.embedding(torch.tensor([0, 2]), X),
    "embedding_bag.default": lambda: F.embedding_bag(torch.tensor([0, 1, 2]), X, torch.tensor([0, 2])),
    "embedding_bag.padding_idx": lambda: torch.ops.aten.embedding_bag.padding_idx(X, torch.tensor([0, 1]), torch.tensor([0]), False, 0, False,
                                                                                   None, False, None),
    "_embedding_bag.default": lambda: torch.ops.aten._embedding_bag(X, torch.tensor([0, 1]), torch.tensor([0, 1])),
    "gather.default": lambda: torch.gather(X, 1, torch.tensor([[0], [3], [1]])),
    "take_along_dim.default": lambda: torch.take_along_dim(X, torch.tensor([[0], [3], [1]]), 1),
    "index_select.default": lambda: torch.index_select(X, 1, torch.tensor([3, 0])),
    "take.default": lambda: torch.take(X, torch.tensor([-1, 0])),
    "index.Tensor": lambda: X[torch.tensor([-1, 0])],
    "index_put.default": lambda: torch.index_put(X, (torch.tensor([0]),), torch.tensor(1.0)),
    "index_put_.default": lambda: X.clone().index_put_((torch.tensor([-1]),), torch.tensor(1.0)),
    "index_add.default": lambda: torch.index_add(X, 0, torch.tensor([2]), torch.ones(1, 4)),
    "index_add_.default": lambda: X.clone().index_add_(0, torch.tensor([2]), torch.ones(1, 4)),
    "index_copy.default": lambda: torch.index_copy(X, 0, torch.tensor([2]), torch.ones(1, 4)),
    "index_copy_.default": lambda: X.clone().index_copy_(0, torch.tensor([2]), torch.ones(1, 4)),
    "index_fill.int_Scalar": lambda: torch.index_fill(X, 1, torch.tensor([-1]), 0.0),
    "index_fill.int_Tensor": lambda: torch.index_fill(X, 1, torch.tensor([0]), torch.tensor(0.0)),
    "index_fill_.int_Scalar": lambda: X.clone().index_fill_(1, torch.tensor([0]), 0.0),
    "scatter.src": lambda: torch.scatter(X, 1, torch.tensor([[3]]), torch.ones(1, 1)),
    "scatter.value": lambda: torch.scatter(X, 1, torch.tensor([[3]]), 2.0),
    "scatter.reduce": lambda: torch.scatter(X, 1, torch.tensor([[3]]), torch.ones(1, 1), reduce="add"),
    "scatter.value_reduce": lambda: torch.scatter(X, 1, torch.tensor([[3]]), 2.0, reduce="multiply"),
    "scatter_.src": lambda: X.clone().scatter_(1, torch.tensor([[3]]), torch.ones(1, 1)),
    "scatter_.value": lambda: X.clone().scatter_(1, torch.tensor([[3]]), 2.0),
    "scatter_add.default": lambda: torch.scatter_add(X, 1, torch.tensor([[3]]), torch.ones(1, 1)),
    "scatter_add_.default": lambda: X.clone().scatter_add_(1, torch.tensor([[3]]), torch.ones(1, 1)),
    "scatter_reduce.two": lambda: torch.scatter_reduce(X, 1, torch.tensor([[3]]), torch.ones(1, 1), "amax"),
    "cross_entropy_loss.default": lambda: F.cross_entropy(X, torch.tensor([0, 3, -100])),
    "nll_loss.default": lambda: F.nll_loss(X, torch.tensor([0, 3, 1])),
    "nll_loss_nd.default": lambda: torch.ops.aten.nll_loss_nd(X, torch.tensor([0, 3, 1])),
    "nll_loss2d.default": lambda: torch.ops.aten.nll_loss2d(X.reshape(1, 3, 2, 2), torch.tensor([[[0, 2], [1, 0]]])),
    "multi_margin_loss.default": lambda: F.multi_margin_loss(X, torch.tensor([0, 3, 1])),
    "multilabel_margin_loss.default": lambda: F.multilabel_margin_loss(X, torch.tensor([[0, 3, -1, 0]] * 3)),
    "ctc_loss.IntList": lambda: F.ctc_loss(X.reshape(3, 1, 4).log_softmax(-1), torch.tensor([[1, 2]]), [3], [2]),
    "ctc_loss.Tensor": lambda: F.ctc_loss(X.reshape(3, 1, 4).log_softmax(-1), torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2])),
    "one_hot.default": lambda: F.one_hot(torch.tensor([0, 2]), 3),
    "bincount.default": lambda: torch.bincount(torch.tensor([0, 2])),
    "repeat_interleave.Tensor": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "repeat_interleave.self_Tensor": lambda: torch.repeat_interleave(X, torch.tensor([1, 0, 2]), 0),
    "searchsorted.Tensor": lambda: torch.searchsorted(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([2.0]), sorter=torch.tensor([1, 2, 0])),
    "searchsorted.Scalar": lambda: torch.searchsorted(torch.tensor([3.0, 1.0, 2.0]), 2.0, sorter=torch.tensor([1, 2, 0])),
}

#: arguments that hold indices or lengths, by name; and ops whose values index though their
#: argument is called otherwise (class targets, bincount's and one_hot's input)
INDEX_ARGS = {"index", "indices", "offsets", "input_lengths", "target_lengths", "sorter", "repeats"}
VALUE_INDEXED = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "multi_margin_loss", "multilabel_margin_loss", "ctc_loss",
                 "one_hot", "bincount"}


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _schema(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload)._schema


def test_every_allowlisted_op_that_indexes_with_tensor_values_has_an_example():
    indexing = {n for n in opset.OPS if {a.name for a in _schema(n).arguments if "Tensor" in str(a.type)} & INDEX_ARGS
                or n.partition(".")[0] in VALUE_INDEXED}
    assert indexing - set(EXAMPLES) == set(), "an allowlisted op indexes with tensor values but no row of INDEX_CHECKS is shown to guard it"
    assert set(EXAMPLES) <= opset.OPS


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_indexing_op_reaches_a_row_of_the_table_and_passes_when_genuine(name):
    seen = _Seen()
    with seen:
        expected = EXAMPLES[name]()
    assert set(seen.ops) & set(INDEX_CHECKS), f"{name} ran {seen.ops}: none is in INDEX_CHECKS"
    with IndexGuard():
        got = EXAMPLES[name]()
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        assert torch.equal(a, b)


def test_no_row_of_the_table_is_dead():
    reached = set()
    for make in EXAMPLES.values():
        seen = _Seen()
        with seen:
            make()
        reached |= set(seen.ops)
    with torch.no_grad():  # embedding_bag without autograd
        seen = _Seen()
        with seen:
            EXAMPLES["embedding_bag.default"]()
        reached |= set(seen.ops)
    assert set(INDEX_CHECKS) - reached == set()


@pytest.mark.parametrize("call, says", [
    (lambda: F.ctc_loss(X.reshape(3, 1, 4).log_softmax(-1), torch.tensor([[1, 1 << 40]]), [3], [2]),
     "indexes with 'targets' values from 1 to 1,099,511,627,776, outside [0, 4)"),
    (lambda: F.ctc_loss(X.reshape(3, 1, 4).log_softmax(-1), torch.tensor([[1, 2]]), [3], [1 << 20]),
     "takes 'target_lengths' from 1,048,576 to 1,048,576 (each at most 2, the targets' length)"),
    (lambda: F.ctc_loss(X.reshape(3, 1, 4).log_softmax(-1), torch.tensor([[1, 2]]), [-7], [2]), "takes 'input_lengths' from -7 to -7"),
    (lambda: F.embedding_bag(torch.tensor([0, 1, 2]), X, torch.tensor([-8, 2])), "takes 'offsets' from -8 to 2, outside [0, 3]"),
    (lambda: F.embedding_bag(torch.tensor([0, 1, 2]), X, torch.tensor([0, 3 << 30])), "takes 'offsets' from 0 to 3,221,225,472"),
    (lambda: F.embedding_bag(torch.tensor([0, 1, 2]), X, torch.tensor([2, 1])), "offsets' that decrease"),
    (lambda: F.embedding_bag(torch.tensor([0, 7]), X, torch.tensor([0])), "indexes with 'indices' values from 0 to 7, outside [0, 3)"),
    (lambda: F.embedding(torch.tensor([-1]), X), "indexes with 'indices' values from -1 to -1, outside [0, 3)"),
    (lambda: torch.gather(X, 1, torch.tensor([[1 << 40]])), "indexes with 'index' values from 1,099,511,627,776"),
    (lambda: torch.index_select(X, 0, torch.tensor([3])), "values from 3 to 3, outside [0, 3)"),
    (lambda: X.clone().scatter_(1, torch.tensor([[-1]]), 1.0), "values from -1 to -1, outside [0, 4)"),
    (lambda: torch.take(X, torch.tensor([-13])), "outside [-12, 12)"),
    (lambda: X[torch.tensor([0]), torch.tensor([4])], "indexes dimension 1 (size 4) with indices[1] values from 4 to 4"),
    (lambda: X[torch.tensor([True, False])], "masks dimensions 0.. of a [3, 4] tensor with a [2] mask"),
    (lambda: X.clone().index_put_((torch.tensor([-4]),), torch.tensor(1.0)), "outside [-3, 3)"),
    (lambda: F.cross_entropy(X, torch.tensor([0, 4, -100])), "values from 0 to 4 (except -100, ignored), outside [0, 4)"),
    (lambda: F.nll_loss(X.reshape(1, 3, 2, 2), torch.tensor([[[0, 2], [1, 9]]])), "values from 0 to 9"),
    (lambda: F.multi_margin_loss(X, torch.tensor([0, 4, 1])), "outside [0, 4)"),
    (lambda: F.multilabel_margin_loss(X, torch.tensor([[0, -2, -1, 0]] * 3)), "outside [-1, 4)"),
    (lambda: torch.searchsorted(torch.tensor([3.0, 1.0]), torch.tensor([2.0]), sorter=torch.tensor([1, 5])), "'sorter' values from 1 to 5"),
    (lambda: torch.bincount(torch.tensor([0, -3])), "'self' values from -3, negative"),
])
def test_an_index_out_of_range_is_refused_before_the_kernel_runs(call, says):
    with IndexGuard(), pytest.raises(ProgramRefused) as e:
        call()
    assert says in str(e.value), str(e.value)
    assert "--model-factory" in e.value.describe(cli=True)


def test_the_guard_is_only_where_it_is_entered():
    assert torch.take(X, torch.tensor([-1])).item() == 11.0
    with pytest.raises(IndexError):  # the kernel's own check, outside the guard: no ProgramRefused
        torch.index_select(X, 0, torch.tensor([3]))


def test_no_uninitialized_memory_reaches_a_guarded_program():
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory)
    with IndexGuard():
        assert torch.empty(64).isnan().all() and (torch.empty(8, dtype=torch.long) == torch.iinfo(torch.long).max).all()
    assert (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory) == before

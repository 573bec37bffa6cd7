"""A one-pass variance goes negative only in the compiled kernel. A hand-written normalisation
computes the variance as E[x^2] - E[x]^2 over 64 features that sit near 10 with a spread of
1e-3 (a sensor with an offset): the two terms are ~100 and cancel, so the float32 result
(true value 1e-6) is rounding noise of either sign. Eagerly it rounds to a value >= -1e-5 and
sqrt(var + 1e-5) is finite; in the kernel inductor generates (the model runs under
torch.compile), the reductions are summed in another order and it rounds below -1e-5 for a
row: sqrt gives NaN. A replay that runs eagerly sees a finite step; only compiled code produces
the NaN, in sample 5 of step 2.

Which offset row inductor rounds below -1e-5 depends on the CPU's vector width (the order of the
partial sums), so ``batches()`` picks it on this machine: the first candidate row whose
variance the compiled model (the training graph, the batch's shape) makes NaN and eager code
does not, placed at row 5 of step 2; the other rows and steps are well conditioned (spread 1)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pytorch/pytorch/issues/114806"
EXPECTED = dict(step=2, phase="none", module=None, op=None, samples=[5], cause="compiler")
TAGS = ("compiler", "float32", "torch-compile", "one-pass-variance")
RECORDER = dict()

_COMPILED: dict = {}


class OnePassNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - m * m  # one pass: cancels catastrophically
        return self.head((x - m) / torch.sqrt(var + 1e-5))


def make_model():
    torch.manual_seed(0)
    return OnePassNorm()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train_step(model, optimizer, batch, recorder, step):
    # the loop compiles the model after the Recorder attached (torch.compile's default backend, inductor)
    run = _COMPILED.get(id(model))
    if run is None or run._orig_mod is not model:
        run = _COMPILED[id(model)] = torch.compile(model)
    recorder.record(batch)
    loss = loss_fn(run, batch)
    recorder.log_loss(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


_BATCHES: list = []


def _offset_row_inductor_rounds_negative() -> torch.Tensor:
    """A [64] row near 10 with spread 1e-3 whose one-pass variance is NaN in the compiled
    model's forward (training graph, a batch of 8) and finite eagerly, on this machine."""
    with torch.random.fork_rng():
        model = make_model()
        compiled = torch.compile(model)
        for seed in range(256):
            g = torch.Generator().manual_seed(seed)
            cand = 10 + 1e-3 * torch.randn(8, 64, generator=g)
            bad_compiled = ~torch.isfinite(compiled(cand)).all(-1)
            with torch.no_grad():
                bad_eager = ~torch.isfinite(model(cand)).all(-1)
            hit = (bad_compiled & ~bad_eager).nonzero().flatten()
            if len(hit):
                return cand[int(hit[0])].clone()
    raise RuntimeError("no offset row rounds below -1e-5 in inductor's kernel here: the case cannot be built on this machine")


def batches():
    if not _BATCHES:
        out = []
        for seed in (15, 16, 3):
            g = torch.Generator().manual_seed(seed)
            out.append((10 + torch.randn(8, 64, generator=g), torch.randint(0, 2, (8,), generator=g)))  # spread 1: well conditioned
        out[2][0][5] = _offset_row_inductor_rounds_negative()
        _BATCHES.extend(out)
    return [(x.clone(), y.clone()) for x, y in _BATCHES]

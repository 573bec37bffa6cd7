"""A spiking network's sigmoid surrogate gradient overflows in its custom backward. The spike
function is a torch.autograd.Function: Heaviside step forward, and in backward the derivative of
sigmoid(slope * u) written as slope * exp(-slope * u) / (exp(-slope * u) + 1) ** 2 (as snnTorch's
surrogate.sigmoid did). With slope 25, a strongly inhibited neuron (u < -3.6) makes exp(-slope*u)
overflow float32 to Inf (it is finite in float64), and Inf / Inf = NaN in its gradient."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/jeshraghian/snntorch/issues/427"
EXPECTED = dict(step=1, phase="backward", module="lif", op=("exp", "SigmoidSpike", "sigmoid_spike"), samples=[5],
                cause="overflow")
TAGS = ("backward", "custom-function", "float32", "snn", "overflow")
RECORDER = dict()

SLOPE, BETA, T = 25.0, 0.5, 6


class SigmoidSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u > 0).to(u.dtype)

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        e = torch.exp(-SLOPE * u)
        return grad * SLOPE * e / (e + 1) ** 2


class LIF(nn.Module):
    """Leaky integrate-and-fire layer unrolled over T time steps (reset by subtraction)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x_seq):
        mem = torch.zeros(x_seq.shape[1], self.fc.out_features)
        spikes = []
        for t in range(x_seq.shape[0]):
            mem = BETA * mem + self.fc(x_seq[t])
            spk = SigmoidSpike.apply(mem - 1.0)
            mem = mem - spk
            spikes.append(spk)
        return torch.stack(spikes)


class SNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lif = LIF(10, 16)
        self.readout = nn.Linear(16, 3)

    def forward(self, x_seq):
        return self.readout(self.lif(x_seq).mean(0))   # rate decoding


def make_model():
    torch.manual_seed(0)
    return SNN()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=5e-4)


def loss_fn(model, batch):
    x_seq, y = batch
    return nn.functional.cross_entropy(model(x_seq), y)


def batches():
    g = torch.Generator().manual_seed(36)
    w = make_model().lif.fc.weight.detach()
    out = []
    for step in range(3):
        x_seq = torch.rand(T, 8, 10, generator=g) * 0.5       # rate-coded input currents
        if step == 1:
            x_seq[:, 5] = -4.0 * torch.sign(w.sum(0))          # a strongly inhibitory stimulus
        y = torch.randint(0, 3, (8,), generator=g)
        out.append((x_seq, y))
    return out

"""log of an STFT magnitude is -inf on a silent clip. A keyword-spotting model computes a
log-magnitude spectrogram in its front end with torch.log(stft(x).abs()), without an epsilon. A
clip of digital silence (all zeros, e.g. a failed decode or a muted recording in the dataset)
gives |STFT| = 0 and log(0) = -inf in every bin; pooling and the classifier turn it into NaN."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/SeanNaren/deepspeech.pytorch/issues/272"
EXPECTED = dict(step=2, phase="forward", module="frontend", op="log", samples=[1], cause="numerics")
TAGS = ("forward", "complex64", "stft", "audio", "float32")
RECORDER = dict()

N_FFT = 64


class LogSpectrogram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))

    def forward(self, wave):
        spec = torch.stft(wave, N_FFT, hop_length=32, window=self.window, return_complex=True)
        return torch.log(spec.abs())          # (B, F, T)


class KWS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frontend = LogSpectrogram()
        self.proj = nn.Linear(N_FFT // 2 + 1, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, wave):
        f = self.frontend(wave).transpose(1, 2)   # (B, T, F)
        return self.head(torch.relu(self.proj(f)).mean(1))


def make_model():
    torch.manual_seed(0)
    return KWS()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    wave, y = batch
    return nn.functional.cross_entropy(model(wave), y)


def batches():
    g = torch.Generator().manual_seed(4)
    out = []
    for step in range(4):
        wave = 0.1 * torch.randn(4, 512, generator=g)
        y = torch.randint(0, 4, (4,), generator=g)
        if step == 2:
            wave[1] = 0.0  # digital silence
        out.append((wave, y))
    return out

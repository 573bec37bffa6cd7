"""CTC loss is Inf when a transcript cannot fit in the input frames. CTCLoss needs at least as many
input frames as target labels (plus one per repeated label); an utterance whose frames were cut
(aggressive downsampling or a truncated file) but whose transcript was not has no valid
alignment, its loss is Inf (zero_infinity=False, the default) and the batch loss is Inf."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/ypwhs/captcha_break/issues/29"
EXPECTED = dict(step=2, phase="loss", module=None, op="ctc_loss", samples=[1], cause="bad input data")
TAGS = ("loss", "ctc", "float32", "speech", "lengths")
RECORDER = dict()

N_CLASSES, T = 6, 12
CTC = nn.CTCLoss(blank=0)


class Acoustic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, N_CLASSES)

    def forward(self, feats):
        h, _ = self.rnn(feats)
        return self.out(h).log_softmax(-1)


def make_model():
    torch.manual_seed(0)
    return Acoustic()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    feats, targets, in_lens, tgt_lens = batch
    log_probs = model(feats).transpose(0, 1)   # (T, B, C)
    return CTC(log_probs, targets, in_lens, tgt_lens)


def batches():
    g = torch.Generator().manual_seed(30)
    out = []
    for step in range(4):
        feats = torch.randn(4, T, 8, generator=g)
        targets = torch.randint(1, N_CLASSES, (4, 5), generator=g)
        in_lens = torch.full((4,), T, dtype=torch.long)
        tgt_lens = torch.tensor([5, 4, 5, 3])
        if step == 2:
            in_lens[1] = 3   # a truncated recording whose transcript was kept whole
        out.append((feats, targets, in_lens, tgt_lens))
    return out

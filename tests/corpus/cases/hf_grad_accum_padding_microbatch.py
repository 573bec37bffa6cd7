"""A Hugging Face-style model returns a NaN loss for a micro-batch that is all padding. A causal LM
computes its loss inside forward() from `labels` (-100 on padding), the way HF models do, and the
loop accumulates gradients over 4 micro-batches. When the last batch of the dataset is padded to
the batch size, a whole micro-batch can consist of padding rows: cross-entropy's mean over zero
labelled tokens is 0/0 = NaN, and the step's loss is NaN. The cross-entropy module built inside
forward() is loss code running in the model: phase "loss", named by the module that runs it (the
root, an HF head)."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/EleutherAI/bergson/pull/461"
EXPECTED = dict(step=1, phase="loss", module="", op=("cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss_nd"),
                samples=None, cause="bad input data")
TAGS = ("forward", "grad-accumulation", "ignore-index", "loss-in-model", "float32", "nlp", "empty-reduction")
RECORDER = dict()

VOCAB, PAD, ACCUM = 32, 0, 4


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mixer = nn.GRU(16, 16, batch_first=True)
        self.lm_head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None):
        h, _ = self.mixer(self.embed(input_ids))
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()   # created in forward, as in HF modeling files
            loss = loss_fct(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def make_model():
    torch.manual_seed(0)
    return TinyCausalLM()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model, batch):
    return model(**batch)["loss"]


def train_step(model, optimizer, batch, recorder, step):
    optimizer.zero_grad()
    total = 0.0
    for micro in batch:
        recorder.record(micro)
        loss = loss_fn(model, micro) / len(batch)
        loss.backward()
        total = total + loss.detach()
    recorder.log_loss(total)
    optimizer.step()


def batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(3):
        micro_batches = []
        for m in range(ACCUM):
            ids = torch.randint(1, VOCAB, (2, 8), generator=g)
            if step == 1 and m == 3:
                ids[:] = PAD  # the tail of the dataset, padded to the batch size
            labels = ids.masked_fill(ids == PAD, -100)
            micro_batches.append({"input_ids": ids, "labels": labels})
        out.append(micro_batches)
    return out

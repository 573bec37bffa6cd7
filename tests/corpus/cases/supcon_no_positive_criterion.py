"""Supervised contrastive loss divides by the number of positives, which can be 0. The SupCon loss
averages log-probabilities over each anchor's positives: (mask * log_prob).sum(1) / mask.sum(1).
An anchor whose class appears only once in the batch has no positive: 0/0 = NaN. Here the loss is
a submodule of the model (model.criterion), called from the loss function."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/HobbitLong/SupContrast/issues/141"
EXPECTED = dict(step=2, phase="loss", module="criterion", op="div", samples=[0, 7], cause="bad input data")
TAGS = ("loss", "criterion-submodule", "float32", "contrastive", "batch-composition")
RECORDER = dict()


class SupConLoss(nn.Module):
    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, features, labels):
        n = features.shape[0]
        mask = (labels[:, None] == labels[None, :]).float()
        logits_mask = 1.0 - torch.eye(n)
        mask = mask * logits_mask
        logits = features @ features.T / self.temperature
        logits = logits - logits.max(1, keepdim=True).values.detach()
        exp_logits = torch.exp(logits) * logits_mask
        log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
        mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
        return -mean_log_prob_pos.mean()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32))
        self.criterion = SupConLoss()

    def forward(self, x):
        return nn.functional.normalize(self.encoder(x), dim=-1)


def make_model():
    torch.manual_seed(0)
    return Net()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_fn(model, batch):
    x, labels = batch
    return model.criterion(model(x), labels)


def batches():
    g = torch.Generator().manual_seed(21)
    out = []
    for step in range(4):
        x = torch.randn(8, 20, generator=g)
        labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        if step == 2:
            labels = torch.tensor([4, 1, 1, 2, 2, 3, 3, 5])  # classes 4 and 5 appear once
        out.append((x, labels))
    return out

"""GCN's symmetric normalisation D^-1/2 A D^-1/2 is Inf for an isolated node. A dense graph
convolution computes deg.pow(-0.5) without adding self-loops (and without PyG's masking of Inf
degrees); a graph in the batch with a node that has no edge (an isolated atom after a parsing
error, a user with no interaction) has degree 0: 0 ** -0.5 = Inf, and Inf * 0 = NaN in the
normalised adjacency."""

import torch
import torch.nn as nn

SOURCE = "https://github.com/pyg-team/pytorch_geometric/issues/61"
EXPECTED = dict(step=1, phase="forward", module="gcn1", op="pow", samples=[2], cause="numerics")
TAGS = ("forward", "float32", "graph", "degree")
RECORDER = dict()

N = 6


class DenseGCN(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x, adj):
        deg = adj.sum(-1)
        d = deg.pow(-0.5)
        norm = d[:, :, None] * adj * d[:, None, :]
        return norm @ self.lin(x)


class GraphClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gcn1 = DenseGCN(5, 16)
        self.gcn2 = DenseGCN(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x, adj):
        h = torch.relu(self.gcn1(x, adj))
        h = torch.relu(self.gcn2(h, adj))
        return self.head(h.mean(1))


def make_model():
    torch.manual_seed(0)
    return GraphClassifier()


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def loss_fn(model, batch):
    x, adj, y = batch
    return nn.functional.cross_entropy(model(x, adj), y)


def batches():
    g = torch.Generator().manual_seed(31)
    ring = torch.roll(torch.eye(N), 1, 0) + torch.roll(torch.eye(N), -1, 0)   # a cycle: every degree is 2
    out = []
    for step in range(3):
        x = torch.randn(4, N, 5, generator=g)
        adj = ring.repeat(4, 1, 1)
        if step == 1:
            adj[2, 4, :] = 0.0   # node 4 of graph 2 lost its edges
            adj[2, :, 4] = 0.0
        y = torch.randint(0, 2, (4,), generator=g)
        out.append((x, adj, y))
    return out

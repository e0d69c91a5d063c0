"""Models from the issue's list that the new ops unblock (issue 20): a GCN (message passing with
index_add and gathers over an edge list), an MLP-Mixer block, a ConvNeXt block (depthwise 7x7 conv,
channels-last LayerNorm, layer scale) and a U-Net block (conv, BatchNorm, max-pool, transposed
conv, bilinear upsampling, concat), each imported with ``ej.from_torch`` on both capture paths and
run on 1 and 2 devices against torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.ops_harness import check_import

class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(6, 8)
        self.lin2 = nn.Linear(8, 3)

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        deg = torch.zeros(x.shape[0]).index_add(0, dst, torch.ones(dst.shape[0])) + 1
        norm = deg.rsqrt()

        def prop(h):
            msg = h[src] * (norm[src] * norm[dst]).unsqueeze(-1)
            return torch.zeros_like(h).index_add(0, dst, msg) + h * (norm * norm).unsqueeze(-1)
        h = F.relu(prop(self.lin1(x)))
        return F.log_softmax(prop(self.lin2(h)), -1)


def test_gcn():
    edges = torch.randint(0, 7, (2, 15), generator=torch.Generator().manual_seed(0))
    check_import(GCN().eval(), (torch.randn(7, 6), edges))


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(8)
        self.tok = nn.Sequential(nn.Linear(5, 10), nn.GELU(), nn.Linear(10, 5))
        self.n2 = nn.LayerNorm(8)
        self.ch = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return (x + self.ch(self.n2(x))).mean(1)


def test_mlp_mixer_block():
    check_import(Mixer().eval(), (torch.randn(2, 5, 8),))


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.norm = nn.LayerNorm(8)
        self.pw1 = nn.Linear(8, 32)
        self.pw2 = nn.Linear(32, 8)
        self.gamma = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def test_convnext_block():
    check_import(ConvNeXt().eval(), (torch.randn(2, 8, 9, 9),))


class UNetBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.up = nn.ConvTranspose2d(6, 3, 2, stride=2)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.down(x))), 2)
        return torch.cat([self.up(h), F.interpolate(h, scale_factor=2, mode="bilinear")[:, :3]], 1)


def test_unet_block():
    m = UNetBlock().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    check_import(m, (torch.randn(2, 3, 8, 8),))

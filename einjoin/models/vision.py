"""Vision models of the zoo in plain torch, written the way people write them, for ``ej.from_torch``:
ResNet-18 (convolutions, batch norm in eval mode, max pooling, residual blocks, adaptive average
pooling) and a ViT-Tiny (a strided convolution as patch embedding, a class token, learned position
embeddings, pre-norm transformer blocks around ``scaled_dot_product_attention``).

>>> import torch
>>> from einjoin.models.vision import ResNet18, ViTTiny
>>> ResNet18(num_classes=10).eval()(torch.randn(2, 3, 64, 64)).shape
torch.Size([2, 10])
>>> ViTTiny(image=32, patch=8, depth=2).eval()(torch.randn(2, 3, 32, 32)).shape
torch.Size([2, 1000])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "ResNet18", "ViTBlock", "ViTTiny"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; a 1x1 strided convolution on the shortcut when the
    shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 (He et al.), torchvision's layout: a 7x7/2 stem, 3x3/2 max pool, four stages of two
    :class:`BasicBlock` (``width``, 2, 4, 8 x ``width`` channels), global average pool, a linear
    classifier. Random batch-norm statistics make eval mode non-trivial."""

    def __init__(self, num_classes: int = 1000, width: int = 64, channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        stages, cin = [], width
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():  # running statistics that are not the identity
            if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None and m.running_var is not None:
                with torch.no_grad():
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        out: torch.Tensor = self.fc(x)
        return out


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block: fused qkv, ``scaled_dot_product_attention``, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class ViTTiny(nn.Module):
    """ViT-Tiny (Dosovitskiy et al.; DeiT-Tiny's sizes: dim 192, 12 blocks, 3 heads, MLP 768): patches
    by a strided convolution, a class token, learned position embeddings, a final LayerNorm and a
    linear head on the class token."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 192, depth: int = 12, heads: int = 3,
                 mlp: int = 768, num_classes: int = 1000, channels: int = 3):
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, dim, patch, stride=patch)
        n = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (b, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x)[:, 0])
        return out

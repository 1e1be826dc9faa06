"""EvoNorm-S0 (Liu et al. 2020) and the ResNet-20-EvoNorm network used for ImageNet."""

from __future__ import annotations

import torch
from torch import nn


def group_count(channels: int, groups: int = 32) -> int:
    """The largest group count <= ``groups`` that divides ``channels`` (32 -> 16 for 16
    channels)."""
    if channels < 1 or groups < 1:
        raise ValueError(f"channels and groups must be positive, got {channels} and {groups}")
    count = min(groups, channels)
    while channels % count:
        count -= 1
    return count


class EvoNormS0(nn.Module):
    """EvoNorm-S0: ``y = x * sigmoid(v * x) / group_std(x) * gamma + beta``.

    ``group_std`` is the per-sample standard deviation over (channels in the group, H, W),
    with the biased (population) variance and ``eps`` inside the square root, as in Liu et
    al. 2020. With ``nonlinearity=False`` the numerator is ``x`` itself, so the layer is a
    batch-independent normalization without activation (used where a ResNet has BatchNorm
    without ReLU: the end of each residual branch and the projection shortcut).
    """

    def __init__(
        self, channels: int, groups: int = 32, eps: float = 1e-5, nonlinearity: bool = True
    ):
        super().__init__()
        if eps <= 0:
            raise ValueError(f"eps must be positive, got {eps}")
        self.channels = channels
        self.groups = group_count(channels, groups)
        self.eps = eps
        self.nonlinearity = nonlinearity
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        if nonlinearity:
            self.v = nn.Parameter(torch.ones(1, channels, 1, 1))
        else:
            self.register_parameter("v", None)

    def extra_repr(self) -> str:
        return (
            f"{self.channels}, groups={self.groups}, eps={self.eps}, "
            f"nonlinearity={self.nonlinearity}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(
                f"expecting input of shape [N, {self.channels}, H, W], got {list(x.shape)}"
            )
        n, c, h, w = x.shape
        grouped = x.reshape(n, self.groups, -1)
        var = grouped.var(dim=2, unbiased=False, keepdim=True)
        std = (var + self.eps).sqrt().expand_as(grouped).reshape(n, c, h, w)
        numerator = x * torch.sigmoid(self.v * x) if self.v is not None else x
        return numerator / std * self.gamma + self.beta


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; EvoNorm-S0 replaces BatchNorm+ReLU and the final BatchNorm."""

    def __init__(self, in_channels: int, channels: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = EvoNormS0(channels, groups)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = EvoNormS0(channels, groups, nonlinearity=False)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            # Projection shortcut (He et al. option B): 1x1 conv + normalization.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                EvoNormS0(channels, groups, nonlinearity=False),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        return torch.relu(out + self.shortcut(x))


class ResNetEvoNorm(nn.Module):
    """CIFAR-style ResNet (3 stages of ``blocks`` basic blocks, widths w, 2w, 4w) with EvoNorm-S0.

    ``stem="imagenet"``: 7x7 stride-2 convolution, EvoNorm-S0 and 3x3 stride-2 max-pooling, so a
    224x224 image enters the first stage at 56x56 (stages at 56, 28, 14). ``stem="cifar"``: one
    3x3 stride-1 convolution, for 32x32 inputs. Global average pooling makes either input-size
    independent.
    """

    def __init__(
        self,
        num_classes: int,
        blocks: int = 3,
        width: int = 16,
        stem: str = "imagenet",
        groups: int = 32,
    ):
        super().__init__()
        if num_classes < 1 or blocks < 1 or width < 1:
            raise ValueError(
                f"num_classes, blocks and width must be positive, got {num_classes}, "
                f"{blocks}, {width}"
            )
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                EvoNormS0(width, groups),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        elif stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 3, padding=1, bias=False), EvoNormS0(width, groups)
            )
        else:
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        stages = []
        in_channels = width
        for stage, channels in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(in_channels, channels, stride, groups))
                in_channels = channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.classifier(torch.flatten(self.pool(x), 1))


def resnet20_evonorm(num_classes: int, stem: str = "imagenet", groups: int = 32) -> ResNetEvoNorm:
    """ResNet-20 (3 stages x 3 blocks x 2 convs + stem + classifier; widths 16/32/64) with
    EvoNorm-S0."""
    return ResNetEvoNorm(num_classes, blocks=3, width=16, stem=stem, groups=groups)

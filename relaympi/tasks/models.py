"""Network definitions shared by the tasks: the digits MLP and VGG-11 without BatchNorm."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# VGG configuration "A" (Simonyan & Zisserman 2015): conv widths, "M" = 2x2 max-pool.
# fmt: skip
VGG11_CONFIG: tuple[int | str, ...] = (
    64,
    "M",
    128,
    "M",
    256,
    256,
    "M",
    512,
    512,
    "M",
    512,
    512,
    "M",
)

# 9,220,480 in the 8 convolutions + 5,130 in Linear(512, 10); tests check it.
VGG11_NUM_PARAMETERS = 9_225_610


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module under a fixed torch seed without touching the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def parameter_bytes(build: Callable[[], nn.Module]) -> int:
    """Bytes of the trainable parameters of the module ``build()`` makes, built on the meta device:
    shapes only, no memory, no draw from torch's random generators."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        module = build()
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def digits_mlp(hidden: int = 64, num_classes: int = 10) -> nn.Module:
    """64 -> hidden -> num_classes MLP with ReLU for flattened 8x8 digit images."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


class VGG11(nn.Module):
    """VGG-11 for 32x32 images without BatchNorm or dropout, as the RelaySum paper uses.

    Eight 3x3 convolutions with ReLU and five max-pools reduce a 32x32 input to a
    512-vector, followed by a single Linear(512, num_classes) (the CIFAR variant with
    ~9.23M parameters for 10 classes; a 512-512-10 MLP head would give ~9.75M).
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in VGG11_CONFIG:
            if width == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, int(width), kernel_size=3, padding=1), nn.ReLU()]
                channels = int(width)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, num_classes)
        # He initialization (fan-out) for the convolutions: without BatchNorm, PyTorch's
        # default init shrinks activations layer by layer and training starts slowly.
        for module in self.features:
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:  # always: built with bias=True
                    nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))

"""EvoNorm-S0 against its defining formula, and the ResNet-20-EvoNorm structure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi.tasks.evonorm import EvoNormS0, ResNetEvoNorm, group_count, resnet20_evonorm


def _evonorm_s0_numpy(x, v, gamma, beta, groups, eps, nonlinearity=True):
    """The formula written out with explicit loops over samples and groups (float64)."""
    n, c, _, _ = x.shape
    size = c // groups
    y = np.empty_like(x)
    for i in range(n):
        for g in range(groups):
            channels = slice(g * size, (g + 1) * size)
            block = x[i, channels]
            std = np.sqrt(np.mean((block - block.mean()) ** 2) + eps)
            if nonlinearity:
                numerator = block * (1.0 / (1.0 + np.exp(-v[channels, None, None] * block)))
            else:
                numerator = block
            y[i, channels] = (
                numerator / std * gamma[channels, None, None] + beta[channels, None, None]
            )
    return y


@pytest.mark.parametrize(
    ("channels", "groups", "nonlinearity"),
    [(64, 32, True), (16, 32, True), (48, 32, True), (12, 4, True), (64, 32, False)],
)
def test_evonorm_s0_matches_formula(channels, groups, nonlinearity):
    rng = np.random.default_rng(channels + groups)
    x = rng.normal(0.3, 2.0, size=(3, channels, 5, 6))
    layer = EvoNormS0(channels, groups=groups, eps=1e-3, nonlinearity=nonlinearity).double()
    gamma, beta, v = (rng.normal(size=channels) for _ in range(3))
    with torch.no_grad():
        layer.gamma.copy_(torch.from_numpy(gamma).view(1, -1, 1, 1))
        layer.beta.copy_(torch.from_numpy(beta).view(1, -1, 1, 1))
        if nonlinearity:
            layer.v.copy_(torch.from_numpy(v).view(1, -1, 1, 1))
    got = layer(torch.from_numpy(x)).detach().numpy()
    want = _evonorm_s0_numpy(x, v, gamma, beta, group_count(channels, groups), 1e-3, nonlinearity)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_evonorm_is_per_sample():
    """In float64 (a float32 batch may round its group variances differently from a single sample's,
    by CPU)."""
    layer = EvoNormS0(32).double()
    x = torch.randn(4, 32, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    np.testing.assert_allclose(
        layer(x)[1:2].detach(), layer(x[1:2]).detach(), rtol=1e-12, atol=1e-14
    )


def test_group_count():
    assert [group_count(c) for c in (16, 32, 48, 64, 96, 3)] == [16, 32, 24, 32, 32, 3]
    with pytest.raises(ValueError, match="positive"):
        group_count(0)


def test_evonorm_rejects_wrong_channels():
    with pytest.raises(
        ValueError, match=r"expecting input of shape \[N, 8, H, W\], got \[2, 4, 3, 3\]"
    ):
        EvoNormS0(8)(torch.zeros(2, 4, 3, 3))


def _resnet20_evonorm_parameters(classes: int, width: int = 16, blocks: int = 3) -> int:
    """Counted from the architecture: bias-free convs, EvoNorm-S0 (gamma, beta [, v]), a linear
    head.

    A k x k conv from c_in to c_out has c_in c_out k^2 weights; EvoNorm-S0 has 3 per channel with
    its nonlinearity (v) and 2 without. Block: conv3x3, EvoNorm, conv3x3, EvoNorm without
    nonlinearity; the first block of stages 2 and 3 adds a 1x1 projection and its EvoNorm.
    """

    def conv(c_in, c_out, k):
        return c_in * c_out * k * k

    def evonorm(c, nonlinearity=True):
        return (3 if nonlinearity else 2) * c

    total = conv(3, width, 7) + evonorm(width)  # stem: 7x7 conv, EvoNorm (max-pool has none)
    c_in = width
    for c in (width, 2 * width, 4 * width):
        for _ in range(blocks):
            total += conv(c_in, c, 3) + evonorm(c) + conv(c, c, 3) + evonorm(c, False)
            if c_in != c:
                total += conv(c_in, c, 1) + evonorm(c, False)
            c_in = c
    return total + c_in * classes + classes  # fully connected layer with bias


def test_resnet20_parameter_count_by_hand():
    # stem 3*16*49 + 3*16 = 2400; stage 1 block 2*16*16*9 + 5*16 = 4688; stage 2 first block 16*32*9
    # + 32*32*9 + 5*32 + 16*32 + 2*32 = 14560, others 2*32*32*9 + 5*32 = 18592; stage 3 first block
    # 32*64*9 + 64*64*9 + 5*64 + 32*64 + 2*64 = 57792, others 74048; fc 64*1000 + 1000 = 65000
    assert (
        _resnet20_evonorm_parameters(1000)
        == 2400 + 3 * 4688 + 14560 + 2 * 18592 + 57792 + 2 * 74048 + 65000
    )
    for width, classes in ((8, 10), (16, 200)):
        model = ResNetEvoNorm(classes, width=width, stem="imagenet")
        assert sum(p.numel() for p in model.parameters()) == _resnet20_evonorm_parameters(
            classes, width
        )


def test_resnet20_structure_and_shapes():
    model = resnet20_evonorm(1000)
    convs = [
        m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)
    ]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(convs) + len(linears) == 20  # stem + 3 stages x 3 blocks x 2 convs + classifier
    assert (
        sum(p.numel() for p in model.parameters()) == _resnet20_evonorm_parameters(1000) == 339_096
    )
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    cifar = ResNetEvoNorm(10, stem="cifar")
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="stem"):
        ResNetEvoNorm(10, stem="bogus")

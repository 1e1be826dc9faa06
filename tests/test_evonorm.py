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
    layer = EvoNormS0(32)
    x = torch.randn(4, 32, 3, 3)
    np.testing.assert_allclose(layer(x)[1:2].detach(), layer(x[1:2]).detach(), rtol=1e-6)


def test_group_count():
    assert [group_count(c) for c in (16, 32, 48, 64, 96, 3)] == [16, 32, 24, 32, 32, 3]
    with pytest.raises(ValueError, match="positive"):
        group_count(0)


def test_evonorm_rejects_wrong_channels():
    with pytest.raises(
        ValueError, match=r"expecting input of shape \[N, 8, H, W\], got \[2, 4, 3, 3\]"
    ):
        EvoNormS0(8)(torch.zeros(2, 4, 3, 3))


def test_resnet20_structure_and_shapes():
    model = resnet20_evonorm(1000)
    convs = [
        m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)
    ]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(convs) + len(linears) == 20  # stem + 3 stages x 3 blocks x 2 convs + classifier
    assert sum(p.numel() for p in model.parameters()) == 339_096
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    cifar = ResNetEvoNorm(10, stem="cifar")
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="stem"):
        ResNetEvoNorm(10, stem="bogus")

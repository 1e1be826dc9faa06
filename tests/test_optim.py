"""Local optimizers against torch.optim where the forms coincide, and against the paper's formulas
written out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from relaympi.optim import OptimizerConfig, make_optimizer

STEPS = 8
DIM = 5


def _problem():
    """A fixed quadratic, so each gradient depends on the iterate (and a wrong update drifts)."""
    rng = np.random.default_rng(7)
    a = rng.normal(size=(DIM, DIM))
    return a.T @ a / DIM + np.eye(DIM), rng.normal(size=DIM), rng.normal(size=DIM)


def _lr(t: int) -> float:
    return 0.1 + 0.02 * t  # time-varying, as warm-up and decay produce


def _ours(
    config: OptimizerConfig, apply: bool = False, ranges: tuple[tuple[int, int], ...] | None = None
) -> np.ndarray:
    """The trajectory of our optimizer; with ``ranges``, each step's update range by range
    (applied)."""
    hessian, b, x0 = _problem()
    x = torch.tensor(x0)
    optimizer = make_optimizer(config, x)
    trajectory = []
    for t in range(STEPS):
        grad = torch.from_numpy(hessian) @ x - torch.from_numpy(b)
        if ranges is not None:
            optimizer.begin_step()
            for lo, hi in ranges:
                optimizer.update_range(grad, x, _lr(t), lo, hi, apply=True)
        elif apply:  # x += u inside the update's sweep
            optimizer.update(grad, x, _lr(t), apply=True)
        else:
            x.add_(optimizer.update(grad, x, _lr(t)))
        trajectory.append(x.numpy().copy())
    return np.array(trajectory)


def _torch(make) -> np.ndarray:
    hessian, b, x0 = _problem()
    param = torch.nn.Parameter(torch.tensor(x0))
    optimizer = make([param])
    trajectory = []
    for t in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _lr(t)
        with torch.no_grad():
            param.grad = torch.from_numpy(hessian) @ param - torch.from_numpy(b)
        optimizer.step()
        trajectory.append(param.detach().numpy().copy())
    return np.array(trajectory)


def _formula(name: str, momentum=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8) -> np.ndarray:
    """The update rules as the paper's appendix and Kingma & Ba write them, one step at a time."""
    hessian, b, x = _problem()
    m, v = np.zeros(DIM), np.zeros(DIM)
    trajectory = []
    for t in range(STEPS):
        g = hessian @ x - b + weight_decay * x  # L2 weight decay: part of the gradient
        lr = _lr(t)
        if name == "sgd":
            x = x - lr * g
        elif name == "nesterov":  # m(t) = a m(t-1) + g;  x(t+1/2) = x(t) - lr (g + a m(t))
            m = momentum * m + g
            x = x - lr * (g + momentum * m)
        elif name == "heavy-ball":  # m(t) = a m(t-1) + g;  x(t+1/2) = x(t) - lr m(t)
            m = momentum * m + g
            x = x - lr * m
        elif name == "adam":
            m = betas[0] * m + (1 - betas[0]) * g
            v = betas[1] * v + (1 - betas[1]) * g * g
            m_hat, v_hat = m / (1 - betas[0] ** (t + 1)), v / (1 - betas[1] ** (t + 1))
            x = x - lr * m_hat / (np.sqrt(v_hat) + eps)
        trajectory.append(x.copy())
    return np.array(trajectory)


CASES: dict[str, tuple[OptimizerConfig, Callable[..., Any], dict[str, Any]]] = {
    "sgd": (
        OptimizerConfig(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        dict(name="sgd"),
    ),
    "sgd-weight-decay": (
        OptimizerConfig(weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05),
        dict(name="sgd", weight_decay=0.05),
    ),
    "nesterov": (  # the paper's form is torch's nesterov=True with dampening 0
        OptimizerConfig(momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        dict(name="nesterov", momentum=0.9),
    ),
    "nesterov-weight-decay": (
        OptimizerConfig(momentum=0.9, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        dict(name="nesterov", momentum=0.9, weight_decay=1e-2),
    ),
    "heavy-ball": (
        OptimizerConfig(momentum=0.5, nesterov=False, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=1e-2),
        dict(name="heavy-ball", momentum=0.5, weight_decay=1e-2),
    ),
    "adam": (
        OptimizerConfig(name="adam"),
        lambda p: torch.optim.Adam(p, lr=0.1),
        dict(name="adam"),
    ),
    "adam-weight-decay-betas": (
        OptimizerConfig(name="adam", weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
        lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        dict(name="adam", weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_optim(case: str) -> None:
    config, make_torch, _ = CASES[case]
    np.testing.assert_allclose(_ours(config), _torch(make_torch), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", CASES)
def test_matches_the_written_out_formula(case: str) -> None:
    config, _, formula = CASES[case]
    np.testing.assert_allclose(_ours(config), _formula(**formula), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", CASES)
def test_cache_blocks_and_applied_updates_change_no_bit(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 2 elements (3 blocks for 5) and x += u inside the sweep: the same bits as one
    block."""
    import relaympi.optim as optim

    config = CASES[case][0]
    whole = _ours(config)
    monkeypatch.setattr(optim, "UPDATE_BLOCK", 2)
    if config.name == "sgd":  # Adam runs one sweep; SGD's blocks are really split
        assert (
            len(make_optimizer(config, torch.zeros(DIM, dtype=torch.float64))._blocks(0, DIM)) == 3
        )
    for apply in (False, True):
        np.testing.assert_array_equal(_ours(config, apply=apply), whole, err_msg=f"apply={apply}")


def test_forms_differ_so_the_comparisons_discriminate() -> None:
    """Nesterov, heavy ball and plain SGD give different iterates on this problem (by > 1e-3)."""
    runs = [_formula(name, momentum=0.9) for name in ("sgd", "nesterov", "heavy-ball")]
    for i in range(3):
        for j in range(i):
            assert np.abs(runs[i] - runs[j]).max() > 1e-3
    assert np.abs(_formula("sgd", weight_decay=0.05) - runs[0]).max() > 1e-3


def test_first_momentum_step_is_the_gradient_step_scaled() -> None:
    """By hand: m(0) = g, so the paper's Nesterov step is -lr (1 + a) g and heavy ball's -lr g."""
    g, x = torch.tensor([1.0, -2.0]), torch.zeros(2)
    nesterov = make_optimizer(OptimizerConfig(momentum=0.9), x).update(g, x, 0.1)
    assert nesterov.tolist() == pytest.approx([-0.19, 0.38])
    heavy = make_optimizer(OptimizerConfig(momentum=0.9, nesterov=False), x).update(g, x, 0.1)
    assert heavy.tolist() == pytest.approx([-0.1, 0.2])
    # Adam's first step is -lr sign(g) (up to eps): m_hat = g, v_hat = g^2
    adam = make_optimizer(OptimizerConfig(name="adam"), x).update(g, x, 0.1)
    assert adam.tolist() == pytest.approx([-0.1, 0.1], rel=1e-6)


def test_state_round_trip_continues_the_same_trajectory() -> None:
    for config in (CASES["nesterov-weight-decay"][0], CASES["adam"][0]):
        x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
        first = make_optimizer(config, x)
        for t in range(3):
            first.update(x * (t + 1), x, 0.1)
        second = make_optimizer(config, x)
        second.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
        g = torch.tensor([0.3, 0.2, -0.1], dtype=torch.float64)
        assert torch.equal(first.update(g, x, 0.05).clone(), second.update(g, x, 0.05))


@pytest.mark.parametrize("case", CASES)
def test_an_update_range_by_range_in_backward_order_changes_no_bit(case: str) -> None:
    """begin_step, then update_range over [3, 5), [1, 3), [0, 1) (last layers first, as backward
    finishes them): the same bits as one update of the whole model (the overlapped step relies on
    it)."""
    config = CASES[case][0]
    np.testing.assert_array_equal(
        _ours(config, ranges=((3, 5), (1, 3), (0, 1))), _ours(config, apply=True)
    )

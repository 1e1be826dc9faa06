"""Local base optimizers (all state local to a worker): SGD, Nesterov momentum in the paper's form, Adam."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relaympi.comm.buffers import padded_zeros_like

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"
    momentum: float = 0.0  # sgd only
    nesterov: bool = True  # the paper's Nesterov form (appendix "RelaySum/Model with momentum")
    weight_decay: float = 0.0  # L2 term added to the gradient
    betas: tuple[float, float] = (0.9, 0.999)  # adam
    eps: float = 1e-8  # adam

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"adam betas must be in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"adam eps must be > 0, got {self.eps}")


class LocalOptimizer:
    """Turns a gradient into a local update u = x(t+1/2) - x(t), in a buffer it owns."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        self.config = config
        self.update_buffer = padded_zeros_like(like)  # spare slots: RelaySGD/Grad relays u without a copy

    def update(self, grad: torch.Tensor, x: torch.Tensor, lr: float) -> torch.Tensor:
        """The update for this step (the returned tensor is reused next step)."""
        raise NotImplementedError

    def _regularized(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.config.weight_decay:
            return grad.add(x, alpha=self.config.weight_decay)
        return grad

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SGD(LocalOptimizer):
    """Plain SGD, or momentum: m = beta m + g; u = -lr (g + beta m) (Nesterov, paper) or u = -lr m (heavy ball)."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        super().__init__(config, like)
        self.momentum_buffer = torch.zeros_like(like) if config.momentum > 0 else None

    def update(self, grad: torch.Tensor, x: torch.Tensor, lr: float) -> torch.Tensor:
        g = self._regularized(grad, x)
        u = self.update_buffer
        beta = self.config.momentum
        if self.momentum_buffer is None:
            torch.mul(g, -lr, out=u)
            return u
        m = self.momentum_buffer
        m.mul_(beta).add_(g)
        if self.config.nesterov:
            torch.add(g, m, alpha=beta, out=u)
            u.mul_(-lr)
        else:
            torch.mul(m, -lr, out=u)
        return u

    def state_dict(self) -> dict[str, Any]:
        return {} if self.momentum_buffer is None else {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.momentum_buffer is not None:
            self.momentum_buffer.copy_(state["momentum_buffer"])


class Adam(LocalOptimizer):
    """Adam with bias correction, as torch.optim.Adam (L2 weight decay added to the gradient)."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        super().__init__(config, like)
        self.exp_avg = torch.zeros_like(like)
        self.exp_avg_sq = torch.zeros_like(like)
        self.steps = 0

    def update(self, grad: torch.Tensor, x: torch.Tensor, lr: float) -> torch.Tensor:
        g = self._regularized(grad, x)
        beta1, beta2 = self.config.betas
        self.steps += 1
        self.exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**self.steps
        bias2 = 1 - beta2**self.steps
        u = self.update_buffer
        torch.div(self.exp_avg_sq, bias2, out=u)
        u.sqrt_().add_(self.config.eps)
        torch.div(self.exp_avg, u, out=u)
        u.mul_(-lr / bias1)
        return u

    def state_dict(self) -> dict[str, Any]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps = int(state["steps"])


def make_optimizer(config: OptimizerConfig, like: torch.Tensor) -> LocalOptimizer:
    return (SGD if config.name == "sgd" else Adam)(config, like)

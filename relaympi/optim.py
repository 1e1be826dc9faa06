"""Local base optimizers (all state local to a worker): SGD, Nesterov momentum in the paper's form,
Adam."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relaympi.flat import padded_zeros_like

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class OptimizerConfig:
    """A local optimizer's settings; ``make_optimizer`` builds the optimizer.

    Attributes:
        name: "sgd" or "adam" (OPTIMIZERS).
        momentum: SGD's momentum beta, in [0, 1) (0: plain SGD).
        nesterov: SGD momentum in the paper's Nesterov form; False: heavy ball.
        weight_decay: the L2 term added to the gradient, >= 0.
        betas: Adam's (beta1, beta2), each in [0, 1).
        eps: Adam's epsilon, > 0.

    Raises:
        ValueError: a setting outside its range, or an unknown name.
    """

    name: str = "sgd"
    momentum: float = 0.0  # sgd only
    nesterov: bool = True  # the paper's Nesterov form (appendix "RelaySum/Model with momentum")
    weight_decay: float = 0.0  # L2 term added to the gradient
    betas: tuple[float, float] = (0.9, 0.999)  # adam
    eps: float = 1e-8  # adam

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"adam betas must be in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"adam eps must be > 0, got {self.eps}")


# Elements per block of the fused update on CPU: the block's gradient, momentum, update and model
# stay in cache across the update's several elementwise ops (a 9.2M-model SGD step with Nesterov
# momentum moves ~6 model-sized arrays through memory instead of ~13). Every op is elementwise,
# so the blocking changes no bit of the result between runs. Device tensors run as one block.
UPDATE_BLOCK = 1 << 17


class LocalOptimizer:
    """Turns a gradient into a local update u = x(t+1/2) - x(t), in a buffer it owns."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        self.config = config
        # spare slots: RelaySGD/Grad relays u without a copy
        self.update_buffer = padded_zeros_like(like)
        self.numel = numel = like.numel()
        self._block = UPDATE_BLOCK if like.device.type == "cpu" else max(numel, 1)
        self._decayed: torch.Tensor | None = None  # one block of grad + weight_decay * x

    def update(
        self, grad: torch.Tensor, x: torch.Tensor, lr: float, apply: bool = False
    ) -> torch.Tensor:
        """The update for this step; with ``apply``, also x += u in the same cache-blocked sweep.
        The same as ``begin_step()`` then ``update_range`` over [0, numel).

        Args:
            grad: the gradient at x, flat as x.
            x: the flat model.
            lr: this step's learning rate.
            apply: add the update to x as well.

        Returns:
            u = x(t+1/2) - x(t), in ``update_buffer`` (the returned tensor is reused next step).
        """
        self.begin_step()
        self.update_range(grad, x, lr, 0, self.numel, apply)
        return self.update_buffer

    def begin_step(self) -> None:  # noqa: B027 - stateless across steps by default
        """Start a step whose update comes range by range (``update_range``): per-step counters
        advance here."""

    def update_range(
        self, grad: torch.Tensor, x: torch.Tensor, lr: float, lo: int, hi: int, apply: bool = False
    ) -> None:
        """u[lo:hi] (in ``update_buffer``) from grad[lo:hi], and with ``apply`` x[lo:hi] +=
        u[lo:hi].

        Every optimizer here is elementwise, so the bits of u do not depend on how a step's
        [0, numel) is cut into ranges, nor on their order: the overlapped and pipelined steps rely
        on it. Each range must be updated once per step, after ``begin_step``.

        Args:
            grad: the gradient at x, flat as x (only [lo, hi) is read).
            x: the flat model.
            lr: this step's learning rate.
            lo: the range's first flat coordinate.
            hi: one past its last.
            apply: add the range's update to x as well.
        """
        for b in self._blocks(lo, hi):
            self._update_block(grad[b], x[b], self.update_buffer[b], b, lr)
            if apply:
                x[b].add_(self.update_buffer[b])

    def _blocks(self, lo: int, hi: int) -> list[slice]:
        return [slice(start, min(start + self._block, hi)) for start in range(lo, hi, self._block)]

    def _update_block(
        self, grad: torch.Tensor, x: torch.Tensor, u: torch.Tensor, b: slice, lr: float
    ) -> None:
        raise NotImplementedError

    def _regularized(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """grad + weight_decay * x (a block of each), in a scratch block that is reused."""
        if not self.config.weight_decay:
            return grad
        if self._decayed is None:
            self._decayed = torch.empty(
                min(self._block, self.numel), dtype=grad.dtype, device=grad.device
            )
        return torch.add(grad, x, alpha=self.config.weight_decay, out=self._decayed[: grad.numel()])

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the optimizer (its buffers and step count).

        Returns:
            Tensors by name, as ``load_state_dict`` takes them back ({} for a stateless one).
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, on resume.

        Args:
            state: the tensors by name, as ``state_dict`` gave them.
        """


class SGD(LocalOptimizer):
    """Plain SGD, or momentum: m = beta m + g; u = -lr (g + beta m) (Nesterov, paper) or u = -lr m
    (heavy ball)."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        super().__init__(config, like)
        self.momentum_buffer = torch.zeros_like(like) if config.momentum > 0 else None

    def _update_block(
        self, grad: torch.Tensor, x: torch.Tensor, u: torch.Tensor, b: slice, lr: float
    ) -> None:
        beta, nesterov = self.config.momentum, self.config.nesterov
        g = self._regularized(grad, x)
        if self.momentum_buffer is None:
            torch.mul(g, -lr, out=u)
            return
        m = self.momentum_buffer[b]
        m.mul_(beta).add_(g)
        if nesterov:
            torch.add(g, m, alpha=beta, out=u)
            u.mul_(-lr)
        else:
            torch.mul(m, -lr, out=u)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the optimizer (its buffers and step count).

        Returns:
            Tensors by name, as ``load_state_dict`` takes them back ({} for a stateless one).
        """
        return {} if self.momentum_buffer is None else {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, on resume.

        Args:
            state: the tensors by name, as ``state_dict`` gave them.
        """
        if self.momentum_buffer is not None:
            self.momentum_buffer.copy_(state["momentum_buffer"])


class Adam(LocalOptimizer):
    """Adam with bias correction, as torch.optim.Adam (L2 weight decay added to the gradient)."""

    def __init__(self, config: OptimizerConfig, like: torch.Tensor):
        super().__init__(config, like)
        self.exp_avg = torch.zeros_like(like)
        self.exp_avg_sq = torch.zeros_like(like)
        self.steps = 0

    def begin_step(self) -> None:
        self.steps += 1

    def _update_block(
        self, grad: torch.Tensor, x: torch.Tensor, u: torch.Tensor, b: slice, lr: float
    ) -> None:
        g = self._regularized(grad, x)
        beta1, beta2 = self.config.betas
        exp_avg, exp_avg_sq = self.exp_avg[b], self.exp_avg_sq[b]
        exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**self.steps
        bias2 = 1 - beta2**self.steps
        torch.div(exp_avg_sq, bias2, out=u)
        u.sqrt_().add_(self.config.eps)
        torch.div(exp_avg, u, out=u)
        u.mul_(-lr / bias1)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the optimizer (its buffers and step count).

        Returns:
            Tensors by name, as ``load_state_dict`` takes them back ({} for a stateless one).
        """
        return {
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "steps": torch.tensor(self.steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, on resume.

        Args:
            state: the tensors by name, as ``state_dict`` gave them.
        """
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps = int(state["steps"])


def make_optimizer(config: OptimizerConfig, like: torch.Tensor) -> LocalOptimizer:
    """The local optimizer ``config`` names, for flat models shaped as ``like``.

    Args:
        config: the optimizer's settings.
        like: a flat model (or every worker's, stacked as rows) whose dtype, device and shape
            the optimizer's buffers take.

    Returns:
        An ``SGD`` or ``Adam`` LocalOptimizer with zero state.

    Example:
        ```python
        x, grad = torch.zeros(10), torch.ones(10)
        sgd = make_optimizer(OptimizerConfig("sgd", momentum=0.9), x)
        sgd.update(grad, x, lr=0.1, apply=True)  # x += u, u = -lr (g + beta m) with m = g
        ```
    """
    return (SGD if config.name == "sgd" else Adam)(config, like)

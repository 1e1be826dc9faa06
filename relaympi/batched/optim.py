"""The local optimizers of relaympi.optim vectorized over workers: rows of X, G are workers."""

from __future__ import annotations

import torch

from relaympi.optim import OptimizerConfig


class BatchedOptimizer:
    """Every worker's local optimizer at once: turns gradients G into updates U = X(t+1/2) - X(t).

    The same elementwise operations, in the same order, as relaympi.optim.SGD and Adam run
    on one worker (so a row agrees with the per-worker optimizer to rounding, bit for bit where
    the kernels are the same). X and G have shape [N, ...]; all state is [N, ...] too.
    """

    def __init__(self, config: OptimizerConfig, X: torch.Tensor):
        if X.dim() < 1:
            raise ValueError(f"X must have a leading worker dimension, got shape {tuple(X.shape)}")
        self.config = config
        self.update_buffer = torch.zeros_like(X)  # also holds the regularized gradient mid-update
        adam = config.name == "adam"
        self.momentum_buffer = torch.zeros_like(X) if (not adam and config.momentum > 0) else None
        self.exp_avg = torch.zeros_like(X) if adam else None
        self.exp_avg_sq = torch.zeros_like(X) if adam else None
        self.steps = 0

    def update(self, G: torch.Tensor, X: torch.Tensor, lr: float, apply: bool = True) -> torch.Tensor:
        """The updates U for this step (the returned tensor is reused next step); with ``apply``, X += U."""
        c, u = self.config, self.update_buffer
        g = torch.add(G, X, alpha=c.weight_decay, out=u) if c.weight_decay else G  # L2 term, as relaympi.optim
        if c.name == "adam":
            self._adam(g, lr)
        elif self.momentum_buffer is None:
            torch.mul(g, -lr, out=u)
        else:  # m = beta m + g;  u = -lr (g + beta m) (Nesterov, paper) or -lr m (heavy ball)
            beta, m = c.momentum, self.momentum_buffer
            m.mul_(beta).add_(g)
            if c.nesterov:
                torch.add(g, m, alpha=beta, out=u)
                u.mul_(-lr)
            else:
                torch.mul(m, -lr, out=u)
        if apply:
            X.add_(u)
        return u

    def _adam(self, g: torch.Tensor, lr: float) -> None:
        """Adam with bias correction (torch.optim.Adam's order of operations); g may be the update buffer."""
        beta1, beta2 = self.config.betas
        self.steps += 1
        self.exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**self.steps
        bias2 = 1 - beta2**self.steps
        u = self.update_buffer  # g is consumed: the buffer may now be overwritten
        torch.div(self.exp_avg_sq, bias2, out=u)
        u.sqrt_().add_(self.config.eps)
        torch.div(self.exp_avg, u, out=u)
        u.mul_(-lr / bias1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.config.name == "adam":
            return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": torch.tensor(self.steps)}
        return {} if self.momentum_buffer is None else {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.config.name == "adam":
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])
            self.steps = int(state["steps"])
        elif self.momentum_buffer is not None:
            self.momentum_buffer.copy_(state["momentum_buffer"])

"""A local optimizer's name and settings (OptimizerConfig), torch-free: the run's configuration
checks them before torch loads; relaympi.optim builds the optimizer (and re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass

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

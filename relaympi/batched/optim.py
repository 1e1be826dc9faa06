"""The local optimizers of relaympi.optim over all workers at once: rows of X, G are workers.

The optimizers are elementwise, so one relaympi.optim optimizer over the flattened [N, ...]
tensors is every worker's optimizer: the same kernels in the same order, bit for bit the
per-worker result, with no second copy of their arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relaympi.optim import OptimizerConfig, make_optimizer


class BatchedOptimizer:
    """Every worker's local optimizer at once: turns gradients G into updates U = X(t+1/2) - X(t).

    X and G have shape [N, ...] and are contiguous; the state (state_dict) is [N, ...] too.
    """

    def __init__(self, config: OptimizerConfig, X: torch.Tensor):
        if X.dim() < 1:
            raise ValueError(f"X must have a leading worker dimension, got shape {tuple(X.shape)}")
        self.config = config
        self.shape = X.shape
        self._flat = make_optimizer(config, X.reshape(-1))

    def update(
        self, G: torch.Tensor, X: torch.Tensor, lr: float, apply: bool = True
    ) -> torch.Tensor:
        """The updates U for this step (the returned tensor is reused next step); with ``apply``, X
        += U."""
        return self._flat.update(G.view(-1), X.view(-1), lr, apply=apply).view(self.shape)

    @property
    def update_buffer(self) -> torch.Tensor:
        """The last step's updates U [N, ...] (what update returned)."""
        return self._flat.update_buffer.view(self.shape)

    def begin_step(self) -> None:
        self._flat.begin_step()

    def update_range(
        self, G: torch.Tensor, X: torch.Tensor, lr: float, lo: int, hi: int, apply: bool = False
    ) -> None:
        """Coordinates [lo, hi) of every worker's update (LocalOptimizer.update_range, elementwise:
        the
        same bits as update)."""
        numel = self.shape[1:].numel()
        rows = (
            [(0, self.shape[0] * numel)]
            if (lo, hi) == (0, numel)
            else [(r * numel + lo, r * numel + hi) for r in range(self.shape[0])]
        )
        for start, end in rows:  # the whole model: one range of the flat buffers
            self._flat.update_range(G.view(-1), X.view(-1), lr, start, end, apply)

    def state_dict(self) -> dict[str, Any]:
        return {
            k: (v.view(self.shape) if v.dim() else v) for k, v in self._flat.state_dict().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._flat.load_state_dict({k: (v.reshape(-1) if v.dim() else v) for k, v in state.items()})

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep the workers at positions ``rows`` of the stack, in that order, and drop the rest:
        each kept worker's state (momentum, Adam's moments, the last update) moves with it; shared
        scalars (Adam's step count) stay. The optimizer then steps [len(rows), ...] models."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        if index.numel() == 0 or len(set(index.tolist())) != index.numel():
            raise ValueError(f"rows must be distinct positions, at least one, got {list(rows)}")
        if int(index.min()) < 0 or int(index.max()) >= self.shape[0]:
            raise ValueError(f"rows must be in [0, {self.shape[0]}), got {list(rows)}")
        old_update = self.update_buffer
        index = index.to(old_update.device)
        state = {
            k: (v.index_select(0, index) if v.dim() else v.clone())
            for k, v in self.state_dict().items()
        }
        self.shape = torch.Size((len(index), *self.shape[1:]))
        like = torch.empty(self.shape.numel(), dtype=old_update.dtype, device=old_update.device)
        self._flat = make_optimizer(self.config, like)
        self.load_state_dict(state)
        self.update_buffer.copy_(old_update.index_select(0, index))

    def place_rows(self, positions: Sequence[int], count: int) -> None:
        """The inverse of ``keep_rows``: the stack grows to ``count`` workers, the current ones at
        ``positions`` (in their order) with their state and last update; every other worker starts
        fresh (zero momentum and moments, a zero last update). Shared scalars (Adam's step count)
        stay: the caller decides whether a fresh worker may share them."""
        index = torch.as_tensor(list(positions), dtype=torch.long)
        if index.numel() != self.shape[0] or len(set(index.tolist())) != index.numel():
            raise ValueError(
                f"positions must name {self.shape[0]} distinct rows, got {list(positions)}"
            )
        if int(index.min()) < 0 or int(index.max()) >= count:
            raise ValueError(f"positions must be in [0, {count}), got {list(positions)}")
        old_update = self.update_buffer
        index = index.to(old_update.device)
        shape = torch.Size((count, *self.shape[1:]))
        state = {}
        for k, v in self.state_dict().items():
            if v.dim():
                grown = v.new_zeros(shape)
                grown.index_copy_(0, index, v)
                state[k] = grown
            else:
                state[k] = v.clone()
        self.shape = shape
        like = torch.empty(shape.numel(), dtype=old_update.dtype, device=old_update.device)
        self._flat = make_optimizer(self.config, like)
        self.load_state_dict(state)
        self.update_buffer.zero_().index_copy_(0, index, old_update)

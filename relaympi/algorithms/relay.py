"""RelaySGD (paper Algorithm 1, with the robust rule) and RelaySGD/Grad (appendix Algorithm
"RelaySum/Grad"):
the rules, once for every engine (RelaySum injected as relays.Relays), and their matrix forms."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from relaympi.algorithms.base import (
    SPANNING_TREES,
    Algorithm,
    Delivered,
    MatrixForm,
    round_id,
)
from relaympi.algorithms.losses import LossyRelaySum
from relaympi.algorithms.options import RelaySGDOptions, RelaySumOptions
from relaympi.algorithms.relays import RangedRelays
from relaympi.topology import Topology

if TYPE_CHECKING:
    from relaympi.algorithms.relays import Factor, Relays


def effective_delays(topology: Topology, layer: int) -> np.ndarray:
    """e_ij = max(tau_ij - 1, 0): worker j's x(s + 1/2) enters x_i(t + 1) for s = t - e_ij
    (Algorithm 1's timing)."""
    return np.maximum(topology.delays(layer) - 1, 0)


def _relays(algorithm: _RelayedSteps, like: torch.Tensor) -> Relays:
    options = algorithm.options
    return algorithm.mixers.relays(
        algorithm.topology, like, in_place=options.relay_in_place, chunk=options.relay_chunk
    )


def _add_scaled(x: torch.Tensor, other: torch.Tensor, factor: Factor) -> None:
    """x += factor * other: a scalar factor (one worker) or one per row of x (every worker at
    once)."""
    if isinstance(factor, float):
        x.add_(other, alpha=factor)
    else:
        x.addcmul_(other, factor)


class _DelayedSum(MatrixForm):
    """RelaySum in matrix form: per coordinate, sum_j V_j(t - e_ij) over the j whose value has
    arrived.

    Columns are the matrix algorithm's width // coordinate_period copies of one period-vector, each
    split
    into the layers' coordinate blocks (layer k relays block k)."""

    def __init__(self, matrix_algorithm: Any) -> None:
        super().__init__(matrix_algorithm)
        d = matrix_algorithm.d
        period = matrix_algorithm.coordinate_period or d
        if d % period:
            raise ValueError(f"width {d} is not a multiple of the coordinate period {period}")
        blocks = matrix_algorithm.topology.coordinate_blocks(period)
        if period == d:
            self.layer_coords = list(blocks)
        else:
            starts = np.arange(0, d, period)[:, None]
            self.layer_coords = [
                (starts + np.arange(b.start, b.stop)[None, :]).ravel() for b in blocks
            ]
        delays = [
            effective_delays(matrix_algorithm.topology, k)
            for k in range(matrix_algorithm.topology.num_layers)
        ]
        self.tau_max = max(int(e.max()) for e in delays)
        # masks[layer][e][i, j] = 1 where j's value from e steps ago reaches i now
        self.masks = [
            [(delay == e).astype(float) for e in range(self.tau_max + 1)] for delay in delays
        ]
        self.history: list[np.ndarray] = []  # the relayed values, newest last

    def delayed_sum(self, current: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The delayed sum including ``current`` (this step's values), and how many values it
        holds."""
        n, d = self.matrix_algorithm.n, self.matrix_algorithm.d
        self.history.append(current)
        del self.history[: -(self.tau_max + 1)]
        total = np.zeros((n, d))
        count = np.zeros((n, d))
        for coords, masks in zip(self.layer_coords, self.masks, strict=True):
            for e in range(min(t, self.tau_max) + 1):
                total[:, coords] += masks[e] @ self.history[-1 - e][:, coords]
                count[:, coords] += masks[e].sum(axis=1, keepdims=True)
        return total, count

    def lossy_relay(self) -> LossyRelaySum:
        """RelaySum message by message, for ``lossy_step`` (built on its first use)."""
        if not hasattr(self, "_lossy"):
            self._lossy = LossyRelaySum(self.matrix_algorithm.topology, self.matrix_algorithm.d)
        return self._lossy


class RelaySGDMatrix(_DelayedSum):
    """X(t+1) = the delayed sum of X(s + 1/2) / how many arrived (counts), or with the missing
    ones filled by X(t) (previous) or x(0) (initial), / n. Under loss the sum is RelaySum's,
    message by message, the counters saying how many parcels it holds."""

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        X_half = X + self.matrix_algorithm.optimizer.update(G, X, lr)
        return self._normalized(X, *self.delayed_sum(X_half, t))

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        X_half = X + self.matrix_algorithm.optimizer.update(G, X, lr)
        received, nbar = self.lossy_relay().step(X_half, round_id(t), delivered)
        return self._normalized(X, X_half + received, nbar)

    def _normalized(self, X: np.ndarray, total: np.ndarray, count: np.ndarray) -> np.ndarray:
        matrix_algorithm = self.matrix_algorithm
        if matrix_algorithm.options.relay_mode == "counts":  # Algorithm 1, line 10
            return total / count
        missing = matrix_algorithm.n - count
        # eq. robust-relaysum-model: missing models replaced by x_i(t), or by x(0)
        fill = (
            X
            if matrix_algorithm.options.relay_mode == "previous"
            else np.broadcast_to(matrix_algorithm.x0, X.shape)
        )
        return (total + missing * fill) / matrix_algorithm.n


class RelaySGDGradMatrix(_DelayedSum):
    """X(t+1) = X(t) + the delayed sum of U(s) / n (under loss: RelaySum's, message by message)."""

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return (
            X
            + self.delayed_sum(self.matrix_algorithm.optimizer.update(G, X, lr), t)[0]
            / self.matrix_algorithm.n
        )

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        U = self.matrix_algorithm.optimizer.update(G, X, lr)
        received, _ = self.lossy_relay().step(U, round_id(t), delivered)
        return X + (U + received) / self.matrix_algorithm.n


class _RelayedSteps(Algorithm):
    """The ranged step over RelaySum (relays.RangedRelays) shared by RelaySGD and RelaySGD/Grad:
    begin_step posts every receive of the parcel, ready(lo, hi) runs the range's local update just
    before its chunks are assembled and sent, finish_step lets ``_landed`` normalize each chunk as
    it
    lands. On any other Relays (the batched engine's) the whole step runs in finish_step. Subclasses
    say what is relayed (``_parcel``) and whether the update is applied to x
    (``applies_update``)."""

    applies_update: ClassVar[bool]
    options: RelaySumOptions

    def _setup(self, x0: torch.Tensor) -> None:
        self.relay = _relays(self, x0)
        # the same object where it runs range by range (RelaySum), else None
        self._ranged_relay = self.relay if isinstance(self.relay, RangedRelays) else None
        self._pipelined = self._ranged_relay is not None

    def _parcel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _landed(self, layer: int, chunk: int, nbar: float) -> None:
        raise NotImplementedError

    def _pipelined_step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.begin_step(x, grad, lr, step)
        self.ready(0, self.numel)
        self.finish_step()

    def begin_step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        if self._ranged_relay is None:  # not self._pipelined
            return super().begin_step(x, grad, lr, step)
        self._ranged = (x, grad, lr, step)
        self.optimizer.begin_step()
        # every receive of the step posted now
        self._ranged_relay.begin(self._parcel(x), round_id(step))

    def ready(self, lo: int, hi: int) -> None:
        if self._ranged_relay is None:  # not self._pipelined
            return
        x, grad, lr, _ = self._ranged
        apply = self.applies_update
        self._ranged_relay.ready(
            lo, hi, lambda a, b: self.optimizer.update_range(grad, x, lr, a, b, apply=apply)
        )

    def finish_step(self) -> None:
        if self._ranged_relay is None:  # not self._pipelined
            return super().finish_step()
        self._ranged_relay.finish(self._landed)
        del self._ranged  # no step in progress: drop its references until the next begin_step

    def state_dict(self) -> dict[str, Any]:
        return self.relay.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.relay.load_state_dict(state)


class RelaySGD(_RelayedSteps):
    """x(t+1/2) = x(t) + u(t); relay x(t+1/2); then per layer with n-bar parcels received:

    - counts   (Algorithm 1):  x(t+1) = (x(t+1/2) + sum_j m_ji) / n-bar
    - previous (eq. robust-relaysum-model): x(t+1) = (x(t+1/2) + sum_j m_ji + (n - n-bar) x(t)) / n
    - initial:  missing parcels replaced by the initial model x(0), divided by n

    One worker's x over a Communicator, or every worker's x as the rows of x [N, numel] when the
    batched engine injects its Mixers: n-bar is then one count per worker (relays.Relays).
    """

    name = "relay"
    summary = "RelaySGD (the paper's Algorithm 1), normalization `counts`/`previous`/`initial`"
    heal_rule = (
        "relay buffers and counters restart at zero over the survivors' trees: each worker relays "
        "only what the survivors sent since, and the counters keep the average normalized"
    )
    topologies = SPANNING_TREES
    matrix_form = RelaySGDMatrix
    options: RelaySGDOptions

    def _setup(self, x0: torch.Tensor) -> None:
        super()._setup(x0)
        self.mode = self.options.relay_mode
        self.x_initial = x0.detach().clone() if self.mode == "initial" else None

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """Over RelaySum (relays.RangedRelays), the step is pipelined chunk by chunk: begin_step,
        ready(0, numel), finish_step. Passes over the model, each cache-blocked: one sweep that
        updates (x += u, the optimizer's own reads and writes) and assembles each message chunk just
        before its send (a leaf: no pass, its chunks are views of x), and one sweep normalizing each
        chunk as it lands: add what arrived and divide (the robust modes fill in the missing parcels
        in the same sweep). On any other Relays (the batched engine's): the same passes one after
        the other, the robust modes adding one pass over the layers with missing parcels."""
        if self._pipelined:
            return self._pipelined_step(x, grad, lr, step)
        u = self.optimizer.update(grad, x, lr, apply=True)  # x(t+1/2) = x(t) + u(t)
        self.relay.exchange(x, round_id(step))
        counts = self.relay.counts()
        if self.mode == "counts":
            self.relay.add_received(
                x, divide_by=[self.relay.factor(nbar, layer) for layer, nbar in enumerate(counts)]
            )
            return
        n = float(self.topology.world_size)
        for layer, nbar in enumerate(counts):
            missing = n - nbar  # on the host
            if not np.any(missing):  # (workers with nothing missing stay as they are)
                continue
            xs, factor = self.relay.coords(x, layer), self.relay.factor(missing, layer)
            if self.mode == "previous":  # x(t) = x(t+1/2) - u(t)
                xs.mul_(1.0 + factor)
                _add_scaled(xs, self.relay.coords(u, layer), -factor)
            else:
                assert self.x_initial is not None  # kept in mode "initial"
                _add_scaled(xs, self.relay.coords(self.x_initial, layer), factor)
        self.relay.add_received(x, divide_by=[n] * len(counts))

    # -- range by range (_RelayedSteps): x(t+1/2) is relayed chunk by chunk ------------------------

    applies_update = (
        True  # x(t+1/2) = x(t) + u(t), chunk by chunk, each just before its messages are sent
    )

    def _parcel(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _landed(self, layer: int, chunk: int, nbar: float) -> None:
        """Normalize one chunk as it lands, as step()'s whole-model rules do, element by element."""
        relay = self._ranged_relay
        assert relay is not None  # called by its finish()
        x = self._ranged[0]
        if self.mode == "counts":
            relay.add_received_chunk(x, layer, chunk, divisor=relay.factor(nbar, layer))
            return
        n = float(self.topology.world_size)
        missing = self.relay.factor(n - nbar, layer)
        fill = None
        if missing and self.mode == "previous":  # x(t) = x(t+1/2) - u(t)
            u = self.optimizer.update_buffer

            def fill(c: slice) -> None:
                x[c].mul_(1.0 + missing)
                _add_scaled(x[c], u[c], -missing)
        elif missing:
            x_initial = self.x_initial
            assert x_initial is not None  # kept in mode "initial"

            def fill(c: slice) -> None:
                _add_scaled(x[c], x_initial[c], missing)

        relay.add_received_chunk(x, layer, chunk, divisor=n, before=fill)


class RelaySGDGrad(_RelayedSteps):
    """u(t) = local update; relay u(t); x(t+1) = x(t) + (u(t) + sum_j m_ji) / n (on any engine, as
    RelaySGD)."""

    name = "relay-grad"
    summary = "RelaySGD/Grad (the paper's appendix)"
    heal_rule = (
        "relay buffers and counters restart at zero over the survivors' trees, as RelaySGD's"
    )
    topologies = SPANNING_TREES
    matrix_form = RelaySGDGradMatrix

    def _setup(self, x0: torch.Tensor) -> None:
        super()._setup(x0)
        self._total = torch.zeros_like(x0)

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """Over RelaySum, pipelined as RelaySGD's step: one sweep computing u (u is the parcel: a
        leaf's chunks are views of it) and assembling each chunk before its send, and one sweep as
        each chunk lands: total = u + what arrived, x += total / n. Elsewhere the same passes in
        turn."""
        if self._pipelined:
            return self._pipelined_step(x, grad, lr, step)
        u = self.optimizer.update(grad, x, lr, apply=False)
        self.relay.exchange(u, round_id(step))
        self._total.copy_(u)
        self.relay.add_received(self._total)
        x.add_(self._total, alpha=1.0 / self.topology.world_size)

    applies_update = False  # u(t) is relayed; x moves only as the chunks land

    def _parcel(self, x: torch.Tensor) -> torch.Tensor:
        return self.optimizer.update_buffer

    def _landed(self, layer: int, chunk: int, nbar: float) -> None:
        relay = self._ranged_relay
        assert relay is not None  # called by its finish()
        x, u, total, scale = (
            self._ranged[0],
            self.optimizer.update_buffer,
            self._total,
            1.0 / self.topology.world_size,
        )
        relay.add_received_chunk(
            total,
            layer,
            chunk,
            before=lambda c: total[c].copy_(u[c]),
            after=lambda c: x[c].add_(total[c], alpha=scale),
        )

"""The injectable Relays: RelaySum as RelaySGD and RelaySGD/Grad communicate through it, on any
engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import torch

    # n-bar and what is computed from it on the host: a float for one worker, one float64 per
    # worker [N]
    Counts = float | np.ndarray
    # a factor of coords(x, layer): a float for one worker, a [N, 1] tensor (one per row) for
    # all workers
    Factor = float | torch.Tensor

# What one implementation's counts() and factor() give: Counts and Factor for one worker (float,
# float) or for every worker at once (np.ndarray, torch.Tensor), never a mix.
CountsT = TypeVar("CountsT")
FactorT = TypeVar("FactorT")


class Relays(Protocol[CountsT, FactorT]):
    """RelaySum (paper Algorithm 1, lines 4-9) on one or more spanning trees: each step every worker
    sends a parcel p(t); back come, per layer (tree k relays the coordinate block ``coords(., k)``),
    the
    sum of the parcels that have reached the worker, p_j(t - tau_ij + 1) for every j, its own p(t)
    included, and n-bar, how many parcels that sum holds. A lost message arrives empty (payload 0,
    counter 0), so n - n-bar parcels are missing.

    Only the mechanism: what an algorithm does with the sums and counts (Algorithm 1's division by
    n-bar, the robust rule's fill-ins, RelaySGD/Grad's 1/n) is the algorithm's, written once in
    relaympi.algorithms.relay. Implemented by relaympi.algorithms.relaysum.RelaySum for one worker
    over
    a Communicator (x a flat vector; gossip.CommMixers.relays builds it) and by
    relaympi.batched.relay.BatchedRelaySum for every worker at once (x [N, d], one count per worker;
    relaympi.batched.mixer.BatchedMixers.relays builds it).
    """

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        """Send ``parcel`` (shaped as x) in communication round ``round`` and receive this step's
        messages."""

    def counts(self) -> list[CountsT]:
        """Per layer, n-bar = 1 + the counters received this step (on the host,
        data-independent)."""

    def factor(self, values: CountsT, layer: int) -> FactorT:
        """``values`` (shaped as counts()'s) as a factor that multiplies or divides coords(x,
        layer)."""

    def add_received(
        self, out: torch.Tensor, divide_by: list[FactorT | float] | None = None
    ) -> None:
        """out += the messages received this step (every layer to its block), then, with
        ``divide_by``, each layer's block /= divide_by[layer]."""

    def coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """The block of ``flat`` (shaped as x) that layer ``layer`` relays, a view."""

    def state_dict(self) -> dict[str, Any]:
        """The messages and counters in flight, to resume exactly."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class RangedRelays(Relays[float, float], Protocol):
    """Relays whose exchange runs range by range (relaympi.algorithms.relaysum.RelaySum): the
    pipelined and overlapped steps (Algorithm.begin_step / ready / finish_step) use it where the
    injected Relays has it; exchange() is begin, ready(0, numel), finish."""

    def begin(self, parcel: torch.Tensor, round: int) -> None:
        """Start the exchange of ``parcel``, whose coordinates become final range by range."""

    def ready(self, lo: int, hi: int, prepare: Callable[[int, int], None] | None = None) -> None:
        """parcel[lo:hi] is final once ``prepare(a, b)`` ran on each piece of it: send what is
        complete."""

    def finish(self, landed: Callable[[int, int, float], None] | None = None) -> None:
        """Complete the exchange; ``landed(layer, chunk, nbar)`` on each chunk as it arrives."""

    def add_received_chunk(
        self,
        out: torch.Tensor,
        layer: int,
        chunk: int,
        divisor: float | None = None,
        before: Callable[[slice], object] | None = None,
        after: Callable[[slice], object] | None = None,
    ) -> None:
        """In ``landed``: out += that chunk's received sum, /= divisor; before/after per cache
        block."""

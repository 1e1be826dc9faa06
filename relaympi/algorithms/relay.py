"""RelaySGD (paper Algorithm 1, with the robust rule) and RelaySGD/Grad (appendix Algorithm "RelaySum/Grad")."""

from __future__ import annotations

import torch

from relaympi.algorithms.base import Algorithm, AlgorithmError, round_id
from relaympi.algorithms.relaysum import DEFAULT_CHUNK, RelaySum

RELAY_MODES = ("counts", "previous", "initial")


def _relaysum(comm, topology, x0, name, options) -> RelaySum:
    if not topology.is_tree:
        raise AlgorithmError(
            f"{name} relays over spanning trees; topology {topology.name!r} is not a tree. Choose chain, star, "
            "binary-tree, double-binary-trees, social-network-tree or a spanning-tree:<graph>"
        )
    chunk = options.relay_chunk or DEFAULT_CHUNK
    return RelaySum(comm, topology, x0.numel(), x0, in_place=options.relay_in_place, chunk=chunk)


class RelaySGD(Algorithm):
    """x(t+1/2) = x(t) + u(t); relay x(t+1/2); then per layer with n-bar parcels received:

    - counts   (Algorithm 1):  x(t+1) = (x(t+1/2) + sum_j m_ji) / n-bar
    - previous (eq. robust-relaysum-model): x(t+1) = (x(t+1/2) + sum_j m_ji + (n - n-bar) x(t)) / n
    - initial:  missing parcels replaced by the initial model x(0), divided by n
    """

    name = "relay"
    default_topology = "double-binary-trees"

    def __init__(self, comm, topology, optimizer, x0, options):
        super().__init__(comm, topology, optimizer, x0, options)
        if options.relay_mode not in RELAY_MODES:
            raise AlgorithmError(f"unknown relay mode {options.relay_mode!r}; choose one of {', '.join(RELAY_MODES)}")
        self.mode = options.relay_mode
        self.relay = _relaysum(comm, topology, x0, "relay", options)
        self.x_initial = x0.detach().clone() if self.mode == "initial" else None

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """Passes over the model besides the optimizer's and the exchange's: x + u, then one
        cache-blocked sweep adding the received sums and dividing (the robust modes add one
        pass over the layers with missing parcels)."""
        u = self.optimizer.update(grad, x, lr, apply=True)  # x(t+1/2) = x(t) + u(t)
        self.relay.exchange(x, round_id(step))
        counts = self.relay.counts()
        if self.mode == "counts":
            self.relay.add_received(x, divide_by=counts)
            return
        n = float(self.comm.world_size)
        for layer, nbar in enumerate(counts):
            missing = n - nbar
            xs = self.relay.coords(x, layer)
            if missing:
                if self.mode == "previous":  # x(t) = x(t+1/2) - u(t)
                    xs.mul_(1.0 + missing).add_(self.relay.coords(u, layer), alpha=-missing)
                else:
                    xs.add_(self.relay.coords(self.x_initial, layer), alpha=missing)
        self.relay.add_received(x, divide_by=[n] * len(counts))

    def state_dict(self):
        return self.relay.state_dict()

    def load_state_dict(self, state):
        self.relay.load_state_dict(state)


class RelaySGDGrad(Algorithm):
    """u(t) = local update; relay u(t); x(t+1) = x(t) + (u(t) + sum_j m_ji) / n."""

    name = "relay-grad"
    default_topology = "double-binary-trees"

    def __init__(self, comm, topology, optimizer, x0, options):
        super().__init__(comm, topology, optimizer, x0, options)
        self.relay = _relaysum(comm, topology, x0, "relay-grad", options)
        self._total = torch.zeros_like(x0)

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        u = self.optimizer.update(grad, x, lr)
        self.relay.exchange(u, round_id(step))
        self._total.copy_(u)
        self.relay.add_received(self._total)
        x.add_(self._total, alpha=1.0 / self.comm.world_size)

    def state_dict(self):
        return self.relay.state_dict()

    def load_state_dict(self, state):
        self.relay.load_state_dict(state)

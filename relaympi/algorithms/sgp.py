"""Stochastic Gradient Push on the time-varying exponential graph (paper appendix Algorithm "SGP"), two rounds per step."""

from __future__ import annotations

import torch

from relaympi.algorithms.base import Algorithm, AlgorithmError, round_id

ROUNDS = 2  # two communication rounds per gradient step equalize bandwidth with RelaySGD


class SGP(Algorithm):
    """Round r (global counter t' = 2 step + r): send x to i - 2^(t' mod log2 n), receive from
    i + 2^(t' mod log2 n), x <- (x + x_received) / 2. With exactly one in- and one out-neighbour
    per round the push-sum weights stay 1, so they are not carried. A lost message leaves the
    receiver's model as it was."""

    name = "sgp"
    default_topology = "exponential"

    def __init__(self, comm, topology, optimizer, x0, options):
        super().__init__(comm, topology, optimizer, x0, options)
        from relaympi.topology import ExponentialSchedule, TopologyError

        if topology.name != "exponential":
            raise AlgorithmError(f"sgp runs on the time-varying 'exponential' topology, not {topology.name!r}")
        try:
            self.schedule = ExponentialSchedule(comm.world_size)
        except TopologyError as exc:
            raise AlgorithmError(f"sgp: {exc}") from exc
        self.received = torch.zeros_like(x0)

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.optimizer.update(grad, x, lr, apply=True)
        if self.comm.world_size == 1:
            return
        rank = self.comm.rank
        for r in range(ROUNDS):
            t = ROUNDS * step + r
            to, frm = self.schedule.send_peer(t, rank), self.schedule.recv_peer(t, rank)
            request = self.comm.exchange({to: x}, {frm: self.received}, tag=0, round=round_id(step, r))
            if frm in request.wait():
                x.add_(self.received).mul_(0.5)

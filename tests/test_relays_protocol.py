"""RelaySGD's and RelaySGD/Grad's rule is written once, RelaySum injected through relays.Relays.

The engines' numbers are held against each other and the oracles in test_algorithms.py,
test_batched_algorithms.py and test_algorithms_with_drops.py; here: one class per rule on both
engines, both RelaySums implement the protocol, and the rule runs unchanged on a third,
independent Relays.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any, cast

import numpy as np
import pytest
import torch

import relaympi.batched.relay as batched_relay
from relaympi.algorithms import ALGORITHMS, AlgorithmOptions
from relaympi.algorithms.losses import LossyRelaySum, layer_coordinates
from relaympi.algorithms.relay import RelaySGD, RelaySGDGrad
from relaympi.algorithms.relays import Relays
from relaympi.algorithms.relaysum import RelaySum
from relaympi.batched import BatchedOptimizer, make_batched_algorithm
from relaympi.batched.algorithms import StackedAlgorithm
from relaympi.comm import DropPolicy
from relaympi.optim import OptimizerConfig
from relaympi.topology import build
from tests.drop_oracle import LossyOracle, delivered_by

PROTOCOL = [
    name
    for name, value in vars(Relays).items()
    if inspect.isfunction(value) and not name.startswith("_")
]


@pytest.mark.parametrize("algo", ["relay", "relay-grad"])
def test_the_batched_engine_runs_the_algorithm_class_itself(algo):
    X0 = torch.zeros(4, 6, dtype=torch.float64)
    batched = make_batched_algorithm(
        algo, build("chain", 4), BatchedOptimizer(OptimizerConfig(), X0), X0, AlgorithmOptions()
    )
    assert isinstance(batched, StackedAlgorithm)
    assert type(batched.stacked) is ALGORITHMS[algo]
    assert isinstance(batched.stacked.relay, batched_relay.BatchedRelaySum)
    assert not hasattr(batched_relay, "BatchedRelaySGD") and not hasattr(
        batched_relay, "BatchedRelaySGDGrad"
    )


@pytest.mark.parametrize("implementation", [RelaySum, batched_relay.BatchedRelaySum])
def test_both_relaysums_implement_the_protocol(implementation):
    assert set(PROTOCOL) == {
        "exchange",
        "counts",
        "factor",
        "add_received",
        "coords",
        "state_dict",
        "load_state_dict",
    }
    for name in PROTOCOL:
        want = list(inspect.signature(getattr(Relays, name)).parameters)
        assert list(inspect.signature(getattr(implementation, name)).parameters) == want, (
            f"{implementation.__name__}.{name}"
        )


def test_the_protocol_imports_without_torch():
    code = (
        "import sys, relaympi.algorithms.relays; sys.exit('torch' in sys.modules or 'numpy' "
        "in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class _OracleRelays:
    """Relays for every worker over relaympi.algorithms.losses.LossyRelaySum (numpy, written from
    the paper): a third engine that shares no code with either RelaySum."""

    def __init__(self, topology, like: torch.Tensor, delivered):
        self.relay, self.delivered = LossyRelaySum(topology, like.shape[1]), delivered
        self.blocks = [
            slice(int(c[0]), int(c[-1]) + 1)
            for c in layer_coordinates(like.shape[1], topology.num_layers)
        ]
        self.sums: Any = None
        self.nbar: Any = None

    def exchange(self, parcel, round):
        self.sums, self.nbar = self.relay.step(parcel.numpy(), round, self.delivered)

    def counts(self):
        return [self.nbar[:, block.start] for block in self.blocks]

    def factor(self, values, layer):
        return torch.as_tensor(np.asarray(values, dtype=np.float64))[:, None]

    def add_received(self, out, divide_by=None):
        out.add_(torch.from_numpy(self.sums))
        for layer, block in enumerate(self.blocks if divide_by is not None else []):
            out[:, block].div_(divide_by[layer])

    def coords(self, flat, layer):
        return flat[:, self.blocks[layer]]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _OracleMixers:
    def __init__(self, delivered):
        self.delivered = delivered

    def relays(self, topology, like, in_place=False, chunk=None):
        return _OracleRelays(topology, like, self.delivered)


@pytest.mark.parametrize(
    "algo,mode",
    [("relay", "counts"), ("relay", "previous"), ("relay", "initial"), ("relay-grad", "counts")],
)
@pytest.mark.parametrize("topo,n", [("chain", 5), ("double-binary-trees", 8)])
def test_the_rule_runs_on_any_relays(algo, mode, topo, n):
    """RelaySGD's and RelaySGD/Grad's own classes, given a Relays of the test's own making, follow
    the
    loss model step for step (float64), dropped messages included."""
    topology, d, steps, lr = build(topo, n), 7, 12, 0.1
    delivered = delivered_by(DropPolicy(0.2, seed=4))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(d, generator=g, dtype=torch.float64)
    targets = torch.randn(n, d, generator=g, dtype=torch.float64)
    X = x0.repeat(n, 1)
    config = OptimizerConfig(momentum=0.9)
    cls = RelaySGD if algo == "relay" else RelaySGDGrad
    # the batched optimizer and the oracle's mixers stand in for a worker's (duck types)
    algorithm = cls(
        None,
        topology,
        BatchedOptimizer(config, X),  # type: ignore[arg-type]
        X.clone(),
        AlgorithmOptions(relay_mode=mode),
        _OracleMixers(delivered),  # type: ignore[arg-type]
    )
    oracle = LossyOracle(algo, topology, x0.numpy(), config, delivered, relay_mode=mode)
    Y = X.numpy().copy()
    lost = 0
    for t in range(steps):
        algorithm.step(X, X - targets, lr, t)
        Y = oracle.step(Y, Y - targets.numpy(), lr, t)
        lost += int((cast(_OracleRelays, algorithm.relay).nbar < n).sum())
        np.testing.assert_allclose(X.numpy(), Y, rtol=1e-12, atol=1e-12, err_msg=f"step {t}")
    assert lost, "no message was lost: the drop rules went untested"

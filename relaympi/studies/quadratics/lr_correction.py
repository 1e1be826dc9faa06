"""Appendix "Learning-rate correction", measured: RelaySGD's 1/(alpha n) on the matrix engine vs
lr_correction()."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from relaympi.algorithms import lr_correction
from relaympi.algorithms.matrix import effective_delays, make_matrix_algorithm
from relaympi.optim import OptimizerConfig
from relaympi.studies.quadratics.findings import Finding, StudyResult
from relaympi.studies.quadratics.tables import expect_row, grid
from relaympi.topology import Topology, build


@dataclass(frozen=True)
class LrCorrectionSettings:
    topologies: tuple[str, ...] = ("chain", "binary-tree", "double-binary-trees", "star")
    n_values: tuple[int, ...] = (4, 16, 64)
    # stop once every value of the last tau_max + 1 steps lies within this relative width
    tolerance: float = 1e-10


@dataclass
class LrCorrectionMeasurement:
    factor: float  # 1 / (alpha n), averaged over layers like relaympi.algorithms.lr_correction
    # per layer: the value every worker settles on after a +1 update on every worker (= alpha n)
    limits: np.ndarray
    steps: int  # steps run after the update
    converged: bool


def measure_lr_correction(
    topology: Topology, tolerance: float = 1e-10, max_steps: int = 200_000
) -> LrCorrectionMeasurement:
    """Measure RelaySGD's learning-rate correction on the matrix engine (appendix "Learning-rate
    correction").

    Every worker holds one coordinate per layer at 0 and runs zero updates until the relay is in
    steady state (after tau_max steps every message has arrived once, so workers divide by n),
    then one update of +1 on every worker, then none. Each new model is a mean of values of the
    last tau_max + 1 steps, so the limit lies between their minimum and maximum: stop once that
    range is narrower than ``tolerance`` (relative) and take its midpoint.
    """
    n, layers = topology.world_size, topology.num_layers
    engine = make_matrix_algorithm("relay", topology, n, np.zeros(layers), OptimizerConfig())
    tau_max = int(max(effective_delays(topology, k).max() for k in range(layers)))
    zero, impulse = np.zeros((n, layers)), -np.ones((n, layers))  # u = -lr g = +1 with lr = 1
    X = np.zeros((n, layers))
    for t in range(tau_max):
        X = engine.step(X, zero, 1.0, t)
    X = engine.step(X, impulse, 1.0, tau_max)
    window = [X]
    low = high = X[0]
    converged = False
    steps = 1
    while steps < max_steps:
        X = engine.step(X, zero, 1.0, tau_max + steps)
        steps += 1
        window.append(X)
        del window[: -(tau_max + 1)]
        stacked = np.stack(window)
        low, high = stacked.min(axis=(0, 1)), stacked.max(axis=(0, 1))
        if steps > tau_max + 1 and np.all(high - low <= tolerance * np.abs(high + low) / 2):
            converged = True
            break
    limits = (low + high) / 2
    return LrCorrectionMeasurement(float(np.mean(1.0 / limits)), limits, steps, converged)


def study_lr_correction(s: LrCorrectionSettings) -> StudyResult:
    result = StudyResult("lr-correction", s)
    for name in s.topologies:
        for n in s.n_values:
            topology = build(name, n)
            start = time.perf_counter()
            measured = measure_lr_correction(topology, s.tolerance)
            computed = lr_correction(topology)
            result.add(
                {
                    "topology": name,
                    "n": n,
                    "measured": measured.factor,
                    "computed": computed,
                    "relative_difference": abs(measured.factor / computed - 1),
                    "steps": measured.steps,
                    "converged": measured.converged,
                    "wall_s": time.perf_counter() - start,
                }
            )
    columns = [f"n={n}" for n in s.n_values]

    def cell(name: str, column: str) -> str:
        row = expect_row(result.rows, topology=name, n=int(column[2:]))
        return f"{row['measured']:.10f} ({row['steps']} steps)"

    result.tables.append(grid("measured 1/(alpha n)", list(s.topologies), columns, cell))
    result.tables.append(
        grid(
            "lr_correction()",
            list(s.topologies),
            columns,
            lambda name, c: (
                f"{expect_row(result.rows, topology=name, n=int(c[2:]))['computed']:.10f}"
            ),
        )
    )
    worst = max(r["relative_difference"] for r in result.rows)
    result.findings = [
        Finding(
            "measured correction factor equals relaympi.algorithms.lr_correction (rel. 1e-9)",
            worst <= 1e-9 and all(r["converged"] for r in result.rows),
            f"largest relative difference {worst:.1e}",
        ),
    ]
    if "chain" in s.topologies and "binary-tree" in s.topologies and len(s.n_values) >= 2:
        chain = [expect_row(result.rows, topology="chain", n=n)["measured"] for n in s.n_values]
        tree = [
            expect_row(result.rows, topology="binary-tree", n=n)["measured"] for n in s.n_values
        ]
        result.findings.append(
            Finding(
                "the correction grows ~linearly in n on a chain and ~logarithmically on a "
                "binary tree",
                chain[-1] / chain[0] > tree[-1] / tree[0],
                f"chain {'/'.join(f'{v:.2f}' for v in chain)}, binary tree "
                f"{'/'.join(f'{v:.2f}' for v in tree)} for n={'/'.join(map(str, s.n_values))}",
            )
        )
    return result

"""--on-failure continue on the in-process backend: a worker lost at step s takes no part in step s
or later, and the survivors' numbers are the matrix oracle's with that worker's row removed at s
(the algorithm built again over the survivors' topology, each survivor's optimizer state kept)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from relaympi.results import read_run
from tests.conftest import run_train as train

pytestmark = pytest.mark.slow  # each case runs the trainer in a subprocess

STEPS, LR, DIM, N = 14, 0.1, 6, 8


def _oracle(problem, algo, topo, optimizer, losses: dict[int, list[int]]):
    """Every step's X [n0, d] by the matrix form, NaN rows for lost workers: at a loss the
    survivors' rows go on in a matrix algorithm built over the survivors' topology (fresh
    algorithm state), their local optimizer's state rows kept."""
    from relaympi.algorithms.matrix import MatrixOptimizer, make_matrix_algorithm
    from relaympi.topology import build
    from relaympi.topology.graphs import exponential

    def topology(count):
        return exponential(count, any_size=True) if topo == "exponential" else build(topo, count)

    members, start = list(range(N)), 0
    X = np.zeros((N, DIM))
    engine = make_matrix_algorithm(algo, topology(N), N, np.zeros(DIM), optimizer)
    wide = [np.zeros((N, DIM))]
    for t in range(STEPS):
        if t in losses:
            keep = [i for i, m in enumerate(members) if m not in losses[t]]
            members = [members[i] for i in keep]
            old = engine.optimizer
            X = X[keep]
            engine = make_matrix_algorithm(
                algo, topology(len(members)), len(members), np.zeros(DIM), optimizer
            )
            fresh = MatrixOptimizer(optimizer, X.shape)
            fresh.m, fresh.v, fresh.steps = old.m[keep], old.v[keep], old.steps
            engine.optimizer = fresh
            engine.form = type(engine.form)(engine)
            start = t  # RelaySum's delays count from its (re)start; SGP's rounds from step 0
            wide[-1] = wide[-1].copy()
            wide[-1][sorted(set(range(N)) - set(members))] = np.nan
        H, c = problem.H[members], problem.c[members]
        G = np.einsum("nij,nj->ni", H, X) - c
        X = engine.step(X, G, LR, t - start if algo.startswith("relay") else t)
        row = np.full((N, DIM), np.nan)
        row[members] = X
        wide.append(row)
    return np.stack(wide)


CASES = [
    ("relay", "chain", 0.0, {5: [3]}),
    ("relay", "double-binary-trees", 0.0, {5: [0], 9: [6]}),
    ("relay-grad", "double-binary-trees", 0.0, {4: [7]}),
    ("dpsgd", "ring", 0.0, {6: [2]}),
    ("qgm", "ring", 0.9, {6: [2]}),
    ("d2", "ring", 0.0, {5: [5]}),
    ("gt", "ring", 0.0, {5: [1, 4]}),
    ("sgp", "exponential", 0.0, {5: [3]}),
    ("allreduce", "fully-connected", 0.9, {7: [0]}),
]


@pytest.mark.parametrize("backend", ["local", "batched"])
@pytest.mark.parametrize(
    "algo, topo, momentum, losses", CASES, ids=[c[0] + "-" + c[1] for c in CASES]
)
def test_survivors_equal_the_matrix_oracle_without_the_lost_rows(
    tmp_path, backend, algo, topo, momentum, losses
):
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import quadratics

    problem_file, out = tmp_path / "problem.h5", tmp_path / "run.h5"
    quadratics.generate(N, quadratics.QuadraticsSpec(dim=DIM, zeta2=1.0, r0=5.0), seed=4).save(
        problem_file
    )
    inject = ",".join(f"{r}:{s}" for s, ranks in losses.items() for r in ranks)
    result = train(
        [
            *("--backend", backend, "--workers", N, "--algo", algo, "--topology", topo),
            *("--momentum", momentum, "--task", "quadratics", "--lr", LR, "--steps", STEPS),
            *("--eval-every", 1, "--record-params", "--dim", DIM),
            *("--problem-file", problem_file, "--out", out, "--on-failure", "continue"),
        ],
        check=0,
        env={"RELAYMPI_INJECT_FAILURE": inject},
    )
    run = read_run(out)
    assert run.status == "completed"
    expected = _oracle(
        quadratics.load(problem_file),
        algo,
        topo,
        OptimizerConfig(momentum=momentum),
        losses,
    )
    params = run.data["params"]
    assert params.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(params), np.isnan(expected))
    np.testing.assert_allclose(params, expected, rtol=0, atol=1e-9)
    # the run file's record of each change, and the summary line
    with h5py.File(out) as f:
        membership = json.loads(f.attrs["membership"])
    assert [(c["step"], sorted(c["lost"]), c["world_size"]) for c in membership] == [
        (step, sorted(ranks), N - sum(len(r) for s, r in losses.items() if s <= step))
        for step, ranks in sorted(losses.items())
    ]
    assert all(c["heal_s"] >= 0 for c in membership)
    lost = sum(len(r) for r in losses.values())
    assert f"{N - lost} of {N} workers finished" in result.stdout


def _readmission_oracle(problem, algo, topo, optimizer, lost_at: int, lost: int, back_at: int):
    """X per step: ``lost`` leaves at ``lost_at`` and comes back at ``back_at`` with the mean of
    its surviving neighbours' models (in the run's topology) and a fresh optimizer state; the
    algorithm starts again over everyone there."""
    from relaympi.algorithms.matrix import MatrixOptimizer, make_matrix_algorithm
    from relaympi.topology import build
    from relaympi.training.membership import readmission_weights

    def engine_for(members, m=None):
        engine = make_matrix_algorithm(
            algo, build(topo, len(members)), len(members), np.zeros(DIM), optimizer
        )
        if m is not None:
            fresh = MatrixOptimizer(optimizer, (len(members), DIM))
            fresh.m = m
            engine.optimizer = fresh
            engine.form = type(engine.form)(engine)
        return engine

    members, start = list(range(N)), 0
    X, engine = np.zeros((N, DIM)), engine_for(list(range(N)))
    wide = [np.zeros((N, DIM))]
    for t in range(STEPS):
        if t == lost_at:
            keep = [i for i, m in enumerate(members) if m != lost]
            members, X, start = [members[i] for i in keep], X[keep], t
            engine = engine_for(members, engine.optimizer.m[keep])
            wide[-1] = wide[-1].copy()
            wide[-1][lost] = np.nan
        if t == back_at:
            full = np.zeros((N, DIM))
            full[members] = X
            weights = readmission_weights(build(topo, N), members, lost)
            full[lost] = sum(w * full[m] for m, w in sorted(weights.items()))
            m = np.zeros((N, DIM))
            m[members] = engine.optimizer.m
            members, X, start = list(range(N)), full, t
            engine = engine_for(members, m)
            wide[-1] = full.copy()
        H, c = problem.H[members], problem.c[members]
        X = engine.step(
            X,
            np.einsum("nij,nj->ni", H, X) - c,
            LR,
            t - start if algo.startswith("relay") else t,
        )
        row = np.full((N, DIM), np.nan)
        row[members] = X
        wide.append(row)
    return np.stack(wide)


@pytest.mark.parametrize("backend", ["local", "batched"])
@pytest.mark.parametrize("algo, topo", [("relay", "double-binary-trees"), ("dpsgd", "ring")])
def test_a_rerun_readmits_the_lost_worker_as_the_oracle_does(tmp_path, backend, algo, topo):
    """Lost at step 4, preempted at 9 with a checkpoint, rerun on the run's worker count: the lost
    worker comes back at 9 with its surviving neighbours' mean model and a fresh optimizer."""
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import quadratics

    problem_file, out = tmp_path / "problem.h5", tmp_path / "run.h5"
    quadratics.generate(N, quadratics.QuadraticsSpec(dim=DIM, zeta2=1.0, r0=5.0), seed=4).save(
        problem_file
    )
    args = [
        *("--backend", backend, "--workers", N, "--algo", algo, "--topology", topo),
        *("--momentum", 0.5, "--task", "quadratics", "--lr", LR, "--steps", STEPS),
        *("--eval-every", 1, "--record-params", "--dim", DIM, "--checkpoint-every", 1),
        *("--problem-file", problem_file, "--out", out, "--on-failure", "continue"),
        *("--checkpoint-dir", tmp_path / "ck"),
    ]
    first = train(
        args,
        env={"RELAYMPI_INJECT_FAILURE": "3:4", "RELAYMPI_INJECT_SIGNAL": "TERM:9"},
    )
    assert read_run(out).status == "preempted", first.stderr[-2000:]
    second = train(args, check=0)
    run = read_run(out)
    assert run.status == "completed"
    expected = _readmission_oracle(
        quadratics.load(problem_file), algo, topo, OptimizerConfig(momentum=0.5), 4, 3, 9
    )
    params = run.data["params"]
    np.testing.assert_array_equal(np.isnan(params), np.isnan(expected))
    np.testing.assert_allclose(params, expected, rtol=0, atol=1e-9)
    with h5py.File(out) as f:
        membership = json.loads(f.attrs["membership"])
    assert [
        (c["step"], c["lost"], c.get("readmitted", []), c["world_size"]) for c in membership
    ] == [
        (4, [3], [], N - 1),
        (9, [], [3], N),
    ]
    assert f"{N} of {N} workers finished" in second.stdout


@pytest.mark.parametrize("algo, topo", [("relay", "double-binary-trees"), ("dpsgd", "ring")])
def test_a_rerun_on_the_survivors_count_resumes_them_without_readmitting(tmp_path, algo, topo):
    """Lost at step 4, preempted at 9, rerun with --workers 7: the survivors go on from their own
    checkpoints as if never stopped (the oracle with the one loss), nobody is re-admitted."""
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import quadratics

    problem_file, out = tmp_path / "problem.h5", tmp_path / "run.h5"
    quadratics.generate(N, quadratics.QuadraticsSpec(dim=DIM, zeta2=1.0, r0=5.0), seed=4).save(
        problem_file
    )

    def args(workers):
        return [
            *("--backend", "local", "--workers", workers, "--algo", algo, "--topology", topo),
            *("--momentum", 0.5, "--task", "quadratics", "--lr", LR, "--steps", STEPS),
            *("--eval-every", 1, "--record-params", "--dim", DIM, "--checkpoint-every", 1),
            *("--problem-file", problem_file, "--out", out, "--on-failure", "continue"),
            *("--checkpoint-dir", tmp_path / "ck"),
        ]

    train(args(N), env={"RELAYMPI_INJECT_FAILURE": "3:4", "RELAYMPI_INJECT_SIGNAL": "TERM:9"})
    assert read_run(out).status == "preempted"
    refused = train(args(N - 2), check=2)
    assert len(refused.stderr.strip().splitlines()) == 1  # any other count: one line
    second = train(args(N - 1), check=0)
    run = read_run(out)
    assert run.status == "completed"
    expected = _oracle(
        quadratics.load(problem_file), algo, topo, OptimizerConfig(momentum=0.5), {4: [3]}
    )
    params = run.data["params"]
    np.testing.assert_array_equal(np.isnan(params), np.isnan(expected))
    np.testing.assert_allclose(params, expected, rtol=0, atol=1e-9)
    with h5py.File(out) as f:
        membership = json.loads(f.attrs["membership"])
    assert [(c["step"], c["lost"], c["world_size"]) for c in membership] == [(4, [3], N - 1)]
    assert f"{N - 1} of {N} workers finished" in second.stdout

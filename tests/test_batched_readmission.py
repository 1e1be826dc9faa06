"""The batched engine re-admits lost workers when a run is resumed from a checkpoint saved after
the loss (BatchedRun.readmit): the rows against an independent replay.

The replay starts from the preempted run's checkpoint file: the survivors' rows, optimizer state,
byte counts and running loss as saved; each re-admitted worker's model is the weighted sum of the
members' rows that ``readmission_weights`` names, its optimizer state zero; then a fresh algorithm
over the run's topology for all workers is stepped with gradients computed here (each worker's
batches by its own id and shard, or its own objective and noise stream). Both sides run the same
kernels on the same rows, so every number must match bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi.batched import BatchedOptimizer, make_batched_algorithm
from relaympi.config import ConfigError
from relaympi.engines.batched.data import BatchedData
from relaympi.engines.batched.run import ModelEngine
from relaympi.optim import OptimizerConfig
from relaympi.results import RunWriter, read_run
from relaympi.tasks.partition import ShardSampler
from relaympi.training import checkpoint_files
from relaympi.training.membership import FAULT_ENV, readmission_weights
from relaympi.training.workloads import run_partition
from tests.test_batched_membership import TASKS, _Losing, _plan, _Replay

N0 = 8
INJECTED = "3:13,6:13"  # lost at step 13, between the evaluations of steps 10 and 20
STOP_AT = 23  # preempted during step 22: the checkpoint of step 23 (not an evaluation step)
STEPS = 40
ALGORITHMS = {
    "relay": ["--algo", "relay", "--topology", "double-binary-trees", "--momentum", "0.9"],
    "dpsgd": ["--algo", "dpsgd", "--topology", "ring"],
}


def _args(task: str, algo: str, checkpoints) -> list[str]:
    return [
        *TASKS[task],
        *ALGORITHMS[algo],
        "--steps",
        str(STEPS),
        "--eval-every",
        "10",
        "--checkpoint-every",
        "5",
        "--checkpoint-dir",
        str(checkpoints),
        "--on-failure",
        "continue",
    ]


@pytest.fixture
def records(monkeypatch):
    """The membership records the runs write, with workers 3 and 6 lost at step 13 (the same
    RELAYMPI_INJECT_FAILURE in every run of a command, as a rerun of it would have). The run
    file's check of a re-admission record is not there yet, so add_membership appends to this
    list instead of the file."""
    monkeypatch.setenv(FAULT_ENV, INJECTED)
    written: list[dict] = []
    monkeypatch.setattr(RunWriter, "add_membership", lambda self, record: written.append(record))
    return written


class _Resumed(_Losing):
    """Keeps the rows X held right after start() (the checkpoint restored, the lost re-admitted)."""

    def start(self):
        super().start()
        self.x_at_start = self.x.clone()


def _preempted_then_resumed(tmp_path, args, stop_at=STOP_AT):
    """The same command twice: preempted at ``stop_at`` after the loss, then run again to the
    end. Returns (the checkpoint the rerun resumed from, its step, the resumed run)."""
    plan = _plan(args, N0).with_out(tmp_path / "run.h5")
    first = _Losing(plan, tmp_path / "run.h5", {})
    steps = iter(range(1, 1000))
    first.stop.is_set = lambda: next(steps) >= stop_at  # type: ignore[method-assign]
    assert first.run() == "preempted"
    directory = plan.cfg.checkpoint_dir
    meta = checkpoint_files.read_meta(directory)
    assert meta is not None
    step = int(meta["step"])
    checkpoint = checkpoint_files.load(directory, 0, step)
    second = _Resumed(_plan(args, N0).with_out(tmp_path / "run.h5"), tmp_path / "run.h5", {})
    assert second.run() == "completed"
    return checkpoint, step, second


def _replay_from(checkpoint, step_s, args, tmp_path):
    """Every original worker's rows from step_s on, replayed from the checkpoint."""
    replay = _Replay(args, {}, tmp_path / "replay.h5")  # its data and gradients; no loop
    plan, schedule = replay.plan, replay.schedule
    members = checkpoint["members"].tolist()
    readmitted = [w for w in range(N0) if w not in members]
    saved = checkpoint["x"]
    X = torch.zeros(N0, saved.shape[1], dtype=saved.dtype)
    for row, worker in enumerate(members):
        X[worker] = saved[row]
    topology0 = plan.topology
    for worker in readmitted:
        weights = readmission_weights(topology0, members, worker)
        model = torch.zeros_like(saved[0])
        for member in sorted(weights):
            model = model + saved[members.index(member)] * weights[member]
        X[worker] = model
    x_at_s = X.clone()
    # the optimizer: the survivors' state from the checkpoint, zeros for the re-admitted
    optimizer = BatchedOptimizer(plan.optimizer, X)
    full_state = {}
    for name, value in checkpoint["optimizer"].items():
        if value.dim():
            grown = torch.zeros((N0, *value.shape[1:]), dtype=value.dtype)
            grown[members] = value
            full_state[name] = grown
        else:
            full_state[name] = value.clone()
    optimizer.load_state_dict(full_state)
    algorithm = make_batched_algorithm(
        plan.cfg.algo, topology0, optimizer, X, plan.algorithm_options, plan.drops
    )
    before = np.zeros(N0)  # bytes before the resume: the survivors' totals, 0 for the re-admitted
    before[members] = checkpoint["bytes_before"].numpy()[members] + np.asarray(
        checkpoint["bytes_sent"], dtype=np.float64
    ).reshape(len(members), -1).sum(axis=1)
    loss_sum, count = checkpoint["loss_sum"].numpy().copy(), int(checkpoint["loss_count"])
    loss_sum[readmitted] = 0.0
    trained = np.full(N0, count, dtype=np.float64)  # steps each worker's loss_sum counts
    trained[readmitted] = 0
    everyone = list(range(N0))
    rows = {}
    for step in range(step_s, schedule.total_steps + 1):
        if step % schedule.eval_every == 0 or step == schedule.total_steps:
            rows[step] = {
                "X": X.clone(),
                "bytes_sent": before + np.asarray(algorithm.bytes_sent, np.float64).sum(axis=1),
                "train_loss": np.divide(
                    loss_sum, trained, out=np.full(N0, np.nan), where=trained > 0
                ),
            }
            loss_sum, trained = np.zeros(N0), np.zeros(N0)
        if step == schedule.total_steps:
            break
        G, losses = replay.gradient(everyone, X, step)
        algorithm.step(X, G, schedule.lr_at(step), step)
        loss_sum += losses
        trained += 1
    return x_at_s, rows, replay


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("task", list(TASKS))
def test_rerun_readmits_the_lost_workers_as_the_replay(tmp_path, records, task, algo):
    args = _args(task, algo, tmp_path / "ckpt")
    checkpoint, step_s, run = _preempted_then_resumed(tmp_path, args)
    assert step_s == STOP_AT and checkpoint["members"].tolist() == [0, 1, 2, 4, 5, 7]
    x_at_s, rows, replay = _replay_from(checkpoint, step_s, args, tmp_path)
    # X at S: survivors' rows as saved, each re-admitted one the mean of its neighbours' rows
    assert torch.equal(run.x_at_start, x_at_s)
    assert run.members == list(range(N0)) and run.n == N0
    assert torch.equal(run.x, rows[STEPS]["X"])  # every worker's model at the end, bit for bit
    data = read_run(tmp_path / "run.h5").data
    steps = list(data["step"])
    assert steps == [0, 10, 20, 30, 40]
    for step, expected in rows.items():
        i = steps.index(step)
        np.testing.assert_array_equal(data["bytes_sent"][i], expected["bytes_sent"], str(step))
        np.testing.assert_array_equal(data["train_loss"][i], expected["train_loss"], str(step))
        if "params" in data:
            np.testing.assert_array_equal(data["params"][i], expected["X"].numpy(), str(step))
            summary = replay.plan.problem.summary(expected["X"].numpy())
            for name, value in summary.items():
                assert data[name][i] == value, (name, step)
        else:
            engine = replay.base.engine
            metrics = engine.model.evaluate(
                expected["X"], engine.task.test_batches(replay.plan.cfg.eval_batch_size)
            )
            for name, values in metrics.items():
                np.testing.assert_array_equal(data[name][i], values.numpy(), f"{name} {step}")
    # the re-admitted workers' columns: numbers before the loss, NaN from it to S, numbers from S
    for name in ("bytes_sent", "train_loss", "time_compute_s"):
        column = data[name][:, [3, 6]]
        assert np.isfinite(column[steps.index(10)]).all(), name
        assert np.isnan(column[steps.index(20)]).all(), name
        assert np.isfinite(column[steps.index(30)]).all() and np.isfinite(column[-1]).all(), name
    # bytes start at 0 for the re-admitted: at step 30 they sent only since S
    assert (data["bytes_sent"][steps.index(30), [3, 6]] < data["bytes_sent"][-1, [3, 6]]).all()
    # the loss, then the re-admission, each recorded once
    assert [(r["step"], r["lost"], r.get("readmitted")) for r in records] == [
        (13, [3, 6], None),
        (STOP_AT, [], [3, 6]),
    ]
    readmission = records[-1]
    assert readmission["world_size"] == N0 and readmission["heal_s"] >= 0
    assert readmission["lost_nodes"] == [] and readmission["lost_hosts"] == []


def test_a_readmission_at_an_evaluation_step(tmp_path, records):
    """Preempted right after the evaluation of step 20: the row of step 20 is written again with
    the re-admitted workers' numbers (a re-admitted worker's train loss there is its current
    loss, as at step 0), and a checkpoint right after it resumes to the same rows."""
    args = _args("quadratics", "relay", tmp_path / "ckpt")
    checkpoint, step_s, run = _preempted_then_resumed(tmp_path, args, stop_at=20)
    assert step_s == 20
    x_at_s, rows, replay = _replay_from(checkpoint, step_s, args, tmp_path)
    data = read_run(tmp_path / "run.h5").data
    steps = list(data["step"])
    assert steps == [0, 10, 20, 30, 40]
    i = steps.index(20)
    np.testing.assert_array_equal(data["params"][i], x_at_s.numpy())
    problem = replay.plan.problem
    current = problem.local_losses(x_at_s.numpy())
    np.testing.assert_array_equal(data["train_loss"][i, [3, 6]], current[[3, 6]])
    survivors = [0, 1, 2, 4, 5, 7]
    assert np.isfinite(data["train_loss"][i, survivors]).all()
    for step in (30, 40):
        np.testing.assert_array_equal(data["params"][steps.index(step)], rows[step]["X"].numpy())
        np.testing.assert_array_equal(
            data["train_loss"][steps.index(step)], rows[step]["train_loss"]
        )
    assert records[-1]["step"] == 20 and records[-1]["readmitted"] == [3, 6]


def test_a_checkpoint_after_the_readmission_resumes_bit_identical(tmp_path, records):
    """Once re-admitted, a run preempted again (before its next evaluation, so the re-admitted
    workers' loss counts since S are in the checkpoint) resumes to the rows of a run not stopped
    the second time; the carried bytes survive the second checkpoint."""

    def rows(name, stops):
        args = _args("quadratics", "relay", tmp_path / f"{name}-ckpt")
        plan = _plan(args, N0)
        status = None
        for stop_at in [*stops, None]:
            run = _Losing(plan.with_out(tmp_path / f"{name}.h5"), tmp_path / f"{name}.h5", {})
            if stop_at is not None:
                steps = iter(range(1, 1000))
                run.stop.is_set = lambda s=steps, a=stop_at: next(s) >= a  # type: ignore
            status = run.run()
        assert status == "completed"
        return read_run(tmp_path / f"{name}.h5").data

    once, twice = rows("once", [STOP_AT]), rows("twice", [STOP_AT, 3])  # 2nd stop: step 26
    for name, values in once.items():
        if not name.startswith("time"):
            np.testing.assert_array_equal(twice[name], values, err_msg=name)


def test_adam_is_refused_in_one_line(tmp_path, records):
    args = [*_args("quadratics", "dpsgd", tmp_path / "ckpt"), "--optimizer", "adam"]
    plan = _plan(args, N0).with_out(tmp_path / "run.h5")
    first = _Losing(plan, tmp_path / "run.h5", {})
    steps = iter(range(1, 1000))
    first.stop.is_set = lambda: next(steps) >= STOP_AT  # type: ignore[method-assign]
    assert first.run() == "preempted"
    with pytest.raises(ConfigError, match="cannot re-admit them under --optimizer adam") as info:
        _Losing(_plan(args, N0).with_out(tmp_path / "run.h5"), tmp_path / "run.h5", {}).run()
    assert "\n" not in str(info.value)


def test_another_worker_count_is_refused_in_one_line(tmp_path, records, monkeypatch):
    args = _args("quadratics", "relay", tmp_path / "ckpt")
    plan = _plan(args, N0).with_out(tmp_path / "run.h5")
    first = _Losing(plan, tmp_path / "run.h5", {})
    steps = iter(range(1, 1000))
    first.stop.is_set = lambda: next(steps) >= STOP_AT  # type: ignore[method-assign]
    assert first.run() == "preempted"
    monkeypatch.delenv(FAULT_ENV)  # it names worker 6, which 6 workers do not have
    with pytest.raises(ConfigError, match="world size 8 vs 6") as info:
        _Losing(_plan(args, 6).with_out(tmp_path / "run.h5"), tmp_path / "run.h5", {}).run()
    assert "\n" not in str(info.value)


def test_the_optimizer_places_rows_back_with_fresh_state():
    X = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    opt = BatchedOptimizer(OptimizerConfig("sgd", momentum=0.9), X)
    opt.update(torch.sin(X), X, 0.1)
    state = {k: v.clone() for k, v in opt.state_dict().items()}
    last = opt.update_buffer.clone()
    opt.keep_rows([0, 2, 3])
    opt.place_rows([0, 2, 3], 4)
    grown = opt.state_dict()["momentum_buffer"]
    assert torch.equal(grown[[0, 2, 3]], state["momentum_buffer"][[0, 2, 3]])
    assert torch.equal(grown[1], torch.zeros(3))
    assert torch.equal(opt.update_buffer[[0, 2, 3]], last[[0, 2, 3]])
    assert torch.equal(opt.update_buffer[1], torch.zeros(3))
    # the next step: each survivor as before, the fresh row as a fresh optimizer's first step
    G = torch.cos(X)
    fresh = BatchedOptimizer(OptimizerConfig("sgd", momentum=0.9), X[[1]].clone())
    kept = BatchedOptimizer(OptimizerConfig("sgd", momentum=0.9), X.clone())
    kept.load_state_dict(state)
    U = opt.update(G, X.clone(), 0.1).clone()
    assert torch.equal(U[1:2], fresh.update(G[[1]], X[[1]].clone(), 0.1))
    assert torch.equal(U[[0, 2, 3]], kept.update(G, X.clone(), 0.1)[[0, 2, 3]])
    for positions, count in (([0, 1], 4), ([0, 0, 1], 4), ([0, 1, 4], 4)):
        with pytest.raises(ValueError):
            opt.place_rows(positions, count)


def test_a_readmitted_worker_draws_the_batches_of_its_id_again():
    plan = _plan(_args("digits", "relay", "unused"), N0)
    engine = ModelEngine(plan, torch.device("cpu"))
    data: BatchedData = engine.data
    data.keep_workers([0, 1, 2, 4, 5, 7])
    data.restore_workers(list(range(N0)))
    assert data.workers == list(range(N0))
    parts = run_partition(engine.task, plan)
    inputs, targets = data.batch(31)
    for worker in range(N0):
        sampler = ShardSampler(parts[worker], plan.cfg.batch_size, plan.cfg.seed, worker)
        x, y = engine.task.train_batch(sampler.batch(31), sampler.rng(31))
        assert torch.equal(inputs[worker], x) and torch.equal(targets[worker], y)
    with pytest.raises(ValueError):
        data.restore_workers([0, 0])
    with pytest.raises(ValueError):
        data.restore_workers([N0])

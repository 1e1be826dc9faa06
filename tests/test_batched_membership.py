"""The batched engine loses workers mid-run (BatchedRun.drop_workers): the survivors' numbers
against an independent replay.

The replay takes the state of a run without losses at the step of the change, keeps the
survivors' rows (models, local optimizer state), builds the algorithm afresh over the topology a
run of the survivors' count resolves to, and steps it with gradients it computes itself: each
survivor's batches drawn by its original id from its own shard (digits), or its own objective and
noise stream (quadratics). Both sides run the same kernels on the same rows, so every survivor's
numbers must match bit for bit; the run file's per-worker columns stay n0 wide, NaN for the lost.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from relaympi.batched import BatchedOptimizer, make_batched_algorithm
from relaympi.comm.base import number_nodes
from relaympi.config import parse_args
from relaympi.engines.batched.data import BatchedData
from relaympi.engines.batched.run import BatchedRun, ModelEngine
from relaympi.optim import OptimizerConfig
from relaympi.results import read_run
from relaympi.tasks.partition import ShardSampler
from relaympi.training.plan import resolve
from relaympi.training.workloads import run_partition

N0 = 8
LOSSES = {10: [3], 40: [5]}  # RELAYMPI_INJECT_FAILURE=3:10,5:40
STEPS = 50

ALGORITHMS = {
    "relay": ["--algo", "relay", "--topology", "double-binary-trees", "--momentum", "0.9"],
    "relay-grad": ["--algo", "relay-grad", "--topology", "chain"],
    "dpsgd": ["--algo", "dpsgd", "--topology", "ring", "--drop-prob", "0.1"],
    "d2": ["--algo", "d2", "--topology", "ring"],
    "gt": ["--algo", "gt", "--topology", "ring"],
    "qgm": ["--algo", "qgm", "--topology", "ring"],
    "allreduce": ["--algo", "allreduce", "--optimizer", "adam", "--weight-decay", "0.01"],
}
TASKS = {
    "quadratics": ["--task", "quadratics", "--sigma2", "0.1", "--record-params", "--lr", "0.05"],
    "digits": ["--task", "digits"],
}


def _args(task: str, algo: str) -> list[str]:
    return [*TASKS[task], *ALGORITHMS[algo], "--steps", str(STEPS), "--eval-every", "10"]


def _plan(args: list[str], workers: int, nodes=None):
    cfg = parse_args([*args, "--backend", "batched", "--workers", str(workers)])
    return resolve(cfg, workers, nodes)


class _Losing(BatchedRun):
    """A batched run whose workers ``losses[step]`` vanish at the start of that step, before its
    evaluation: where the training loop calls drop_workers."""

    def __init__(self, plan, out, losses, check_lag=None):
        super().__init__(
            plan, out, "test", BatchedOptimizer, make_batched_algorithm, threading.Event()
        )
        self.losses, self.dropped = dict(losses), set()
        self.check_lag = check_lag or self.check_lag

    def _due(self, step):
        if step in self.losses and step not in self.dropped:
            self.dropped.add(step)
            self.drop_workers(self.losses[step], step)

    def evaluate(self, step):
        self._due(step)
        super().evaluate(step)

    def gradient(self, step):
        self._due(step)
        return super().gradient(step)


class _Replay:
    """The survivors' run, computed apart from drop_workers: a batched run without losses up to the
    first change, then each membership's rows stepped by a fresh algorithm with gradients computed
    here. Records, per evaluation step, every original worker's model, mean train loss and bytes."""

    def __init__(self, args, losses, out, nodes=None):
        self.args, self.nodes = args, nodes
        plan = _plan(args, N0, nodes).with_out(out)  # never written: the replay runs no loop
        self.base = BatchedRun(
            plan, out, "test", BatchedOptimizer, make_batched_algorithm, threading.Event()
        )
        self.plan, self.losses = plan, losses
        self.schedule = self.base.schedule
        self.rows: dict[int, dict[str, Any]] = {}
        engine = self.base.engine
        if isinstance(engine, ModelEngine):
            cfg = plan.cfg
            parts = run_partition(engine.task, plan)
            self.samplers = [ShardSampler(parts[r], cfg.batch_size, cfg.seed, r) for r in range(N0)]

    def gradient(self, members, X, step):
        engine = self.base.engine
        if isinstance(engine, ModelEngine):
            pairs = [
                engine.task.train_batch(self.samplers[r].batch(step), self.samplers[r].rng(step))
                for r in members
            ]
            inputs = torch.stack([i for i, _ in pairs])
            targets = torch.stack([t for _, t in pairs])
            G, losses = engine.model.gradients(X, inputs, targets)
            return G, losses.double().numpy()
        problem, seed = self.plan.problem, self.plan.cfg.seed
        H, c = torch.from_numpy(problem.H[members]), torch.from_numpy(problem.c[members])
        G = torch.bmm(H, X.unsqueeze(2)).squeeze(2).sub_(c)
        G.add_(torch.from_numpy(np.stack([problem.noise(seed, step, r) for r in members])))
        r = np.einsum("nij,nj->ni", problem.A[members], X.numpy()) - problem.b[members]
        return G, np.sum(r * r, axis=1)  # f_i = ||A_i x - b_i||^2

    def run(self):
        base, schedule = self.base, self.schedule
        members = list(range(N0))
        X, optimizer, algorithm = base.engine.X, base.optimizer, base.algorithm
        before = np.zeros(N0)  # bytes of earlier algorithms, per original worker
        inter_before = np.zeros(N0)
        loss_sum, count = np.zeros(N0), 0
        for step in range(schedule.total_steps + 1):
            if step in self.losses:
                node_of = np.asarray(self.nodes or [0] * N0)
                sent = np.zeros(N0)
                sent[members] = algorithm.bytes_sent.sum(axis=1)
                across = np.asarray(algorithm.bytes_sent, dtype=np.float64) * (
                    node_of[members][:, None] != node_of[members][None, :]
                )
                inter_before[members] += across.sum(axis=1)
                before += sent
                before[self.losses[step]] = np.nan
                inter_before[self.losses[step]] = np.nan
                keep = [i for i, m in enumerate(members) if m not in self.losses[step]]
                members = [members[i] for i in keep]
                state = optimizer.state_dict()
                X = X[keep].clone()
                optimizer = BatchedOptimizer(self.plan.optimizer, X)
                optimizer.load_state_dict(
                    {k: (v[keep].clone() if v.dim() else v) for k, v in state.items()}
                )
                survivor_nodes = number_nodes(node_of[members].tolist())
                topology = _plan(
                    self.args, len(members), survivor_nodes if self.nodes else None
                ).topology
                algorithm = make_batched_algorithm(
                    self.plan.cfg.algo,
                    topology,
                    optimizer,
                    X,
                    self.plan.algorithm_options,
                    self.plan.drops,
                    nodes=survivor_nodes if self.nodes else None,
                )
            if step % schedule.eval_every == 0 or step == schedule.total_steps:
                full = np.full((N0, X.shape[1]), np.nan)
                full[members] = X.numpy()
                sent = before.copy()
                sent[members] += algorithm.bytes_sent.sum(axis=1)
                node_of = np.asarray(self.nodes or [0] * N0)[members]
                inter = inter_before.copy()
                inter[members] += (
                    np.asarray(algorithm.bytes_sent, dtype=np.float64)
                    * (node_of[:, None] != node_of[None, :])
                ).sum(axis=1)
                train_loss = np.full(N0, np.nan)
                train_loss[members] = (loss_sum / count)[members] if count else np.nan
                self.rows[step] = {
                    "X": full,
                    "survivors": X.clone(),
                    "members": list(members),
                    "bytes_sent": sent,
                    "inter_node_bytes_sent": inter,
                    "train_loss": train_loss,
                }
                loss_sum, count = np.zeros(N0), 0
            if step == schedule.total_steps:
                break
            G, losses = self.gradient(members, X, step)
            algorithm.step(X, G, schedule.lr_at(step), step)
            loss_sum[members] += losses
            count += 1
        return self.rows


def _check_against_replay(tmp_path, args, losses, nodes=None, check_lag=None):
    plan = _plan(args, N0, nodes).with_out(tmp_path / "lost.h5")
    run = _Losing(plan, tmp_path / "lost.h5", losses, check_lag)
    assert run.run() == "completed"
    assert run.members == [w for w in range(N0) if w not in sum(losses.values(), [])]
    assert run.n0 == N0 and run.x.shape[0] == len(run.members)
    replay = _Replay(args, losses, tmp_path / "replay.h5", nodes)
    rows = replay.run()
    data = read_run(tmp_path / "lost.h5").data
    steps = list(data["step"])
    assert steps == sorted(rows)
    last = rows[steps[-1]]
    assert torch.equal(run.x, last["survivors"])  # every survivor's model, bit for bit
    for i, step in enumerate(steps):
        row, lost = rows[step], [w for w in range(N0) if w not in rows[step]["members"]]
        np.testing.assert_array_equal(data["bytes_sent"][i], row["bytes_sent"], err_msg=str(step))
        np.testing.assert_array_equal(
            data["inter_node_bytes_sent"][i], row["inter_node_bytes_sent"], err_msg=str(step)
        )
        if i:  # step 0 records the loss before any step
            np.testing.assert_array_equal(data["train_loss"][i], row["train_loss"])
        for name in ("time_compute_s", "time_comm_s", "bytes_sent"):
            assert (
                np.isnan(data[name][i][lost]).all()
                and np.isfinite(data[name][i][row["members"]]).all()
            )
        if "params" in data:
            np.testing.assert_array_equal(data["params"][i], row["X"], err_msg=str(step))
            summary = replay.plan.problem.summary(row["survivors"].numpy())
            for name, value in summary.items():
                assert data[name][i] == value, (name, step)
        else:
            engine = replay.base.engine
            assert isinstance(engine, ModelEngine)
            metrics = engine.model.evaluate(
                row["survivors"], engine.task.test_batches(plan.cfg.eval_batch_size)
            )
            for name, values in metrics.items():
                expected = np.full(N0, np.nan)
                expected[row["members"]] = values.numpy()
                np.testing.assert_array_equal(data[name][i], expected, err_msg=f"{name} {step}")
    return data


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("task", list(TASKS))
def test_survivors_equal_an_independent_replay_bit_for_bit(tmp_path, task, algo):
    data = _check_against_replay(tmp_path, _args(task, algo), LOSSES)
    # worker 3 is NaN from step 10's row on, worker 5 from step 40's; the others never
    steps = list(data["step"])
    assert np.isfinite(data["bytes_sent"][steps.index(0)]).all()
    assert np.isnan(data["bytes_sent"][steps.index(10), 3]) and np.isfinite(
        data["bytes_sent"][steps.index(10), 5]
    )
    assert np.isnan(data["bytes_sent"][steps.index(40)][[3, 5]]).all()


@pytest.mark.parametrize("algo", ["relay", "allreduce"])
def test_a_loss_between_evaluations_with_workers_on_nodes(tmp_path, algo):
    """Workers lost at steps between evaluations, a whole node among them: the survivors'
    topology (relay) and all-reduce tree are placed by their nodes, and the bytes to other nodes
    carry over per original worker."""
    nodes = [0, 0, 0, 1, 1, 1, 2, 2]
    args = [*_args("quadratics", algo), "--placement", "nodes"]
    data = _check_against_replay(tmp_path, args, {13: [3, 4, 5], 27: [0]}, nodes=nodes)
    assert np.nanmax(data["inter_node_bytes_sent"][-1]) > 0


def test_the_optimizer_keeps_each_kept_workers_state():
    X = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    opt = BatchedOptimizer(OptimizerConfig("adam"), X)
    for lr in (0.1, 0.2):
        opt.update(torch.sin(X * lr), X, lr)
    state = {k: v.clone() for k, v in opt.state_dict().items()}
    last = opt.update_buffer.clone()
    opt.keep_rows([3, 0])
    kept = opt.state_dict()
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(kept[name], state[name][[3, 0]])
    assert int(kept["steps"]) == 2 and torch.equal(opt.update_buffer, last[[3, 0]])
    # the next step of the two kept rows is the step a two-row optimizer with that state takes
    Y = X[[3, 0]].clone()
    other = BatchedOptimizer(OptimizerConfig("adam"), Y)
    other.load_state_dict({k: v.clone() for k, v in kept.items()})
    G = torch.cos(Y)
    assert torch.equal(opt.update(G, Y.clone(), 0.3), other.update(G, Y.clone(), 0.3))
    with pytest.raises(ValueError):
        opt.keep_rows([2])


def test_each_survivor_draws_the_batches_of_its_original_id():
    plan = _plan(_args("digits", "relay"), N0)
    engine = ModelEngine(plan, torch.device("cpu"))
    data: BatchedData = engine.data
    data.keep_workers([0, 1, 2, 4, 5, 6, 7])
    data.keep_workers([0, 1, 2, 3, 4, 6])  # original ids 0 1 2 4 5 7: 3 then 6 lost
    assert data.workers == [0, 1, 2, 4, 5, 7]
    parts = run_partition(engine.task, plan)
    for step in (0, 17, 400):
        inputs, targets = data.batch(step)
        for row, worker in enumerate(data.workers):
            sampler = ShardSampler(parts[worker], plan.cfg.batch_size, plan.cfg.seed, worker)
            x, y = engine.task.train_batch(sampler.batch(step), sampler.rng(step))
            assert torch.equal(inputs[row], x) and torch.equal(targets[row], y)


def test_drop_workers_refuses_what_is_not_a_current_worker(tmp_path):
    plan = _plan(_args("quadratics", "allreduce"), 4).with_out(tmp_path / "r.h5")
    run = _Losing(plan, tmp_path / "r.h5", {})
    run.drop_workers([1], 0)
    assert run.members == [0, 2, 3]
    for lost in ([1], [7], [], [0, 0], [0, 2, 3]):
        with pytest.raises(ValueError):
            run.drop_workers(lost, 1)


def test_a_loss_while_the_losses_of_earlier_steps_are_unread(tmp_path):
    """As on a GPU, the host reads the losses every few steps: the losses of the steps before a
    change, read after it, still count for the survivors (worker 0 among the lost)."""
    args = _args("quadratics", "relay")
    _check_against_replay(tmp_path, args, {13: [3], 27: [0, 6]}, check_lag=4)


@pytest.mark.parametrize("task", list(TASKS))
def test_sgp_survivors_equal_the_replay_where_their_count_suits_its_schedule(tmp_path, task):
    """SGP's exponential graph needs a power-of-two count: 8 workers, 4 lost at once."""
    args = [*TASKS[task], "--algo", "sgp", "--steps", "30", "--eval-every", "10"]
    _check_against_replay(tmp_path, args, {17: [1, 2, 5, 6]})

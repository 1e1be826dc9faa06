"""The rules that shape a run, against values counted by hand: the learning-rate schedule, the
step accounting (steps per epoch, epochs, run length), when a run evaluates and checkpoints, and
RelaySGD's lr correction.

Every expected number below is written out with its arithmetic in a comment; none is computed
by the code under test. The run-file tests use digits with a large batch so that an epoch is
three steps (the recipe's shape in miniature), or small quadratics.
"""

# Long module: every rule that shapes a run's steps, against values counted by hand

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaympi import train
from relaympi.config import parse_args
from relaympi.results import read_run
from relaympi.tasks.partition import steps_per_epoch
from relaympi.training import checkpoint_files
from relaympi.training.plan import Schedule, resolve
from relaympi.training.workloads import ModelWorkload, build_workload
from tests.conftest import matched, requires_mpirun, run_module, run_train


def _schedule(**fields) -> Schedule:
    base = dict(
        steps_per_epoch=10,
        total_steps=100,
        eval_every=10,
        checkpoint_every=10,
        lr=1.0,
        warmup_steps=0,
        warmup_from=0.0,
        milestone_steps=(),
    )
    return Schedule(**{**base, **fields})


def _lrs(schedule: Schedule, steps) -> list[float]:
    return [schedule.lr_at(s) for s in steps]


# -- 1. Schedule.lr_at by hand ------------------------------------------------------------------
def test_warmup_starts_at_warmup_from_and_ends_at_the_base_lr():
    # lr 0.5, 4 warm-up steps from 0.2: factor(t) = 0.2 + (1 - 0.2) * t / 4 = 0.2 + 0.2 t
    #   t = 0: 0.2 -> 0.1;  t = 1: 0.4 -> 0.2;  t = 2: 0.6 -> 0.3;  t = 3: 0.8 -> 0.4
    # t = 4 is the first step after warm-up: factor 1 -> 0.5; t = 5: 0.5
    schedule = _schedule(lr=0.5, warmup_steps=4, warmup_from=0.2)
    assert _lrs(schedule, range(6)) == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.5], rel=1e-12, abs=0
    )


def test_warmup_from_zero_takes_no_step_at_step_0():
    # lr 0.8, 3 warm-up steps from 0: factor(t) = t / 3 -> 0, 0.8/3, 1.6/3, then 0.8 from t = 3 on
    schedule = _schedule(lr=0.8, warmup_steps=3, warmup_from=0.0)
    assert schedule.lr_at(0) == 0.0
    assert _lrs(schedule, range(1, 5)) == pytest.approx(
        [0.8 / 3, 1.6 / 3, 0.8, 0.8], rel=1e-12, abs=0
    )


def test_each_milestone_divides_by_ten_at_its_own_step():
    # lr 2, milestones at steps 3 and 5, no warm-up:
    #   t = 0, 1, 2: 2;  t = 3 (first milestone): 2 / 10 = 0.2;  t = 4 (the step before the
    #   second): 0.2;  t = 5 (second milestone): 2 / 100 = 0.02;  t = 6: 0.02
    schedule = _schedule(lr=2.0, milestone_steps=(3, 5))
    assert _lrs(schedule, range(7)) == pytest.approx(
        [2.0, 2.0, 2.0, 0.2, 0.2, 0.02, 0.02], rel=1e-12, abs=0
    )


def test_warmup_then_milestones():
    # lr 1, warm-up 2 steps from 0.5 (factor 0.5 + 0.5 t / 2: t = 0 -> 0.5, t = 1 -> 0.75),
    # milestones at steps 4, 6, 7: t = 2, 3: 1;  t = 4, 5: 0.1;  t = 6: 0.01;  t = 7, 8: 0.001
    schedule = _schedule(lr=1.0, warmup_steps=2, warmup_from=0.5, milestone_steps=(4, 6, 7))
    assert _lrs(schedule, range(9)) == pytest.approx(
        [0.5, 0.75, 1.0, 1.0, 0.1, 0.1, 0.01, 0.001, 0.001], rel=1e-12, abs=0
    )


def test_paper_recipes_in_steps():
    # CIFAR-10, 16 workers x 32 samples: 50000 / 512 = 97.66 -> 98 steps per epoch;
    # 5 warm-up epochs = 490 steps from 0; milestones at epochs 150, 180 = steps 14700, 17640;
    # 200 epochs = 19600 steps; lr 0.15 (relay's default).
    cifar = resolve(parse_args(["--task", "cifar10", "--algo", "relay"]), 16).schedule(98)
    assert (cifar.warmup_steps, cifar.milestone_steps, cifar.total_steps) == (
        490,
        (14700, 17640),
        19600,
    )
    # t = 245: 0.15 * 245 / 490 = 0.075; t = 489: 0.15 * 489 / 490; t = 490: 0.15
    # t = 14699: 0.15; t = 14700: 0.015; t = 17639: 0.015; t = 17640: 0.0015
    steps = [0, 245, 489, 490, 14699, 14700, 17639, 17640, 19599]
    hand = [0.0, 0.075, 0.15 * 489 / 490, 0.15, 0.15, 0.015, 0.015, 0.0015, 0.0015]
    assert _lrs(cifar, steps) == pytest.approx(hand, rel=1e-12, abs=0)
    # ImageNet with 100 steps per epoch: lr 0.2 warmed up from 0.5 * 0.2 = 0.1 over 500 steps,
    # milestones 30, 60, 80 epochs = steps 3000, 6000, 8000.
    # t = 250: 0.2 * (0.5 + 0.5 * 250 / 500) = 0.15;  t = 2999: 0.2;  t = 3000: 0.02;
    # t = 5999: 0.02;  t = 6000: 0.002;  t = 7999: 0.002;  t = 8000: 0.0002
    imagenet = resolve(parse_args(["--task", "imagenet", "--algo", "relay"]), 16).schedule(100)
    assert (imagenet.warmup_steps, imagenet.milestone_steps) == (500, (3000, 6000, 8000))
    steps = [0, 250, 499, 500, 2999, 3000, 5999, 6000, 7999, 8000]
    hand = [0.1, 0.15, 0.2 * (0.5 + 0.5 * 499 / 500), 0.2, 0.2, 0.02, 0.02, 0.002, 0.002, 0.0002]
    assert _lrs(imagenet, steps) == pytest.approx(hand, rel=1e-12, abs=0)


def test_one_worker_has_no_warmup():
    # --warmup-epochs 5 at 10 steps per epoch would be 50 steps with n > 1; one worker (the
    # centralized baseline) starts at the full lr 0.3, and the milestone (epoch 2 = step 20) stays.
    args = [
        "--task",
        "digits",
        "--algo",
        "allreduce",
        "--lr",
        "0.3",
        "--warmup-epochs",
        "5",
        "--milestones",
        "2",
    ]
    one = resolve(parse_args(args), 1).schedule(10)
    assert one.warmup_steps == 0
    assert _lrs(one, [0, 1, 19, 20]) == pytest.approx([0.3, 0.3, 0.3, 0.03], rel=1e-12, abs=0)
    two = resolve(parse_args(args), 2).schedule(10)
    assert two.warmup_steps == 50 and two.lr_at(0) == 0.0  # digits warms up from 0


# -- 1. steps per epoch, epochs and run length by hand ------------------------------------------
def test_steps_per_epoch_counts_the_whole_training_set():
    # ceil(num_train / (world_size * batch_size)):
    #   10 / (2 * 3) = 1.67 -> 2;  12 / 6 = 2 -> 2;  13 / 6 = 2.17 -> 3;  1 / 64 -> 1
    assert steps_per_epoch(10, 2, 3) == 2
    assert steps_per_epoch(12, 2, 3) == 2
    assert steps_per_epoch(13, 2, 3) == 3
    assert steps_per_epoch(1, 4, 16) == 1


# digits: 1797 images; the test split takes round(0.2 * count) per class: the class counts
# 178 182 177 183 181 182 181 179 174 180 give 36 36 35 37 36 36 36 36 35 36 = 359 test images,
# so 1797 - 359 = 1438 train. Two workers of batch 240: 1438 / 480 = 2.996 -> 3 steps per epoch.
DIGITS_TRAIN = 1438
DIGITS = ["--task", "digits", "--alpha", "1", "--batch-size", "240", "--seed", "5"]


def test_digits_workload_epoch_accounting_with_shards_that_do_not_divide_the_batch():
    plan = resolve(parse_args([*DIGITS, "--algo", "relay", "--steps", "10"]), 2)
    workloads = [build_workload(plan, rank, "cpu") for rank in range(2)]
    shards = [w.shard_size for w in workloads if isinstance(w, ModelWorkload)]
    # the case under test
    assert sum(shards) == DIGITS_TRAIN and all(s % 240 for s in shards), shards
    assert [w.steps_per_epoch for w in workloads] == [3, 3]
    schedule = plan.schedule(3)
    # epoch = step / 3: 0, 1/3, ..., 10/3; epochs 1, 2, 3 end at steps 3, 6, 9
    assert [schedule.epoch_at(s) for s in (0, 1, 3, 7, 9)] == pytest.approx(
        [0, 1 / 3, 1, 7 / 3, 3], rel=1e-12, abs=0
    )


@pytest.mark.parametrize(
    "epochs, spe, total",
    [
        (2, 3, 6),  # 2 * 3 = 6 steps
        (0.5, 3, 2),  # 0.5 * 3 = 1.5 -> 2: the last, partial epoch is run
        # 1.1 * 90 = 99 exactly (float: 99.00000000000001, which must not become 100)
        (1.1, 90, 99),
        (0.07, 100, 7),  # 0.07 * 100 = 7 (float: 7.000000000000001)
        (0.001, 90, 1),  # 0.09 -> at least one step
    ],
)
def test_run_length_from_epochs(epochs, spe, total):
    plan = resolve(parse_args(["--task", "digits", "--algo", "relay", "--epochs", str(epochs)]), 2)
    assert plan.schedule(spe).total_steps == total


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs", "inf"], "--epochs must be > 0 and finite, got inf"),
        (["--lr", "inf", "--steps", "2"], "--lr must be > 0 and finite, got inf"),
        (["--warmup-epochs", "nan", "--steps", "2"], "--warmup-epochs must be >= 0, got nan"),
        (["--warmup-epochs", "-1", "--steps", "2"], "--warmup-epochs must be >= 0, got -1.0"),
        (["--milestones", "150,nan", "--steps", "2"], "--milestones must be >= 0, got nan"),
    ],
)
def test_schedule_flags_out_of_range_exit_2(tmp_path, capsys, args, message):
    # before: inf epochs and NaN warm-up or milestones ended in a traceback (exit 1), -1 warm-up
    # epochs silently meant none
    code = _main(
        [
            "--task",
            "digits",
            "--backend",
            "local",
            "--workers",
            "2",
            *args,
            "--out",
            tmp_path / "r.h5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: {message}", err
    assert not (tmp_path / "r.h5").exists()


# -- 1. the run file's lr, epoch and step on every backend --------------------------------------
# lr 0.8, one warm-up epoch = 3 steps from 0, milestones at epochs 2 and 3 = steps 6 and 9:
#   t = 0: 0;  t = 1: 0.8 / 3;  t = 2: 1.6 / 3;  t = 3, 4, 5: 0.8;  t = 6, 7, 8: 0.08;
#   t = 9, 10: 0.008
RECIPE = [
    *DIGITS,
    "--algo",
    "relay",
    "--lr",
    "0.8",
    "--warmup-epochs",
    "1",
    "--milestones",
    "2,3",
    "--steps",
    "10",
    "--eval-every",
    "1",
]
RECIPE_LR = [0.0, 0.8 / 3, 1.6 / 3, 0.8, 0.8, 0.8, 0.08, 0.08, 0.08, 0.008, 0.008]
RECIPE_EPOCH = [s / 3 for s in range(11)]  # 3 steps per epoch (see above)


def _main(args) -> int:
    return train.main([str(a) for a in args])


def _check_recipe(out: Path) -> None:
    run = read_run(out)
    assert run.status == "completed"
    assert run.data["step"].tolist() == list(range(11))
    np.testing.assert_allclose(run.data["lr"], RECIPE_LR, rtol=1e-12, atol=0)
    np.testing.assert_allclose(run.data["epoch"], RECIPE_EPOCH, rtol=1e-12, atol=0)
    assert run.config["total_steps"] == 10 and run.config["lr_effective"] == 0.8


@pytest.mark.parametrize("backend", ["local", "batched"])
def test_run_file_lr_follows_the_recipe(tmp_path, backend):
    assert _main([*RECIPE, "--backend", backend, "--workers", "2", "--out", tmp_path / "r.h5"]) == 0
    _check_recipe(tmp_path / "r.h5")


@pytest.mark.slow
@requires_mpirun
def test_run_file_lr_follows_the_recipe_under_mpirun(tmp_path):
    proc = run_train([*RECIPE, "--out", tmp_path / "r.h5"], mpi=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_recipe(tmp_path / "r.h5")


def test_run_file_one_worker_has_no_warmup(tmp_path):
    # one worker: no warm-up; lr 0.8 until the milestone at epoch 2 = step 2 * 6 = 12 (one worker
    # of batch 240: 1438 / 240 = 5.99 -> 6 steps per epoch), so steps 0..3 are all at 0.8;
    # the epoch is step / 6
    args = [
        *DIGITS,
        "--algo",
        "allreduce",
        "--lr",
        "0.8",
        "--warmup-epochs",
        "1",
        "--milestones",
        "2",
        "--steps",
        "3",
        "--eval-every",
        "1",
        "--backend",
        "local",
        "--workers",
        "1",
        "--out",
        tmp_path / "one.h5",
    ]
    assert _main(args) == 0
    run = read_run(tmp_path / "one.h5")
    np.testing.assert_allclose(run.data["lr"], [0.8] * 4, rtol=1e-12, atol=0)
    np.testing.assert_allclose(run.data["epoch"], [0, 1 / 6, 2 / 6, 3 / 6], rtol=1e-12, atol=0)


# -- 2. when a run evaluates and checkpoints ------------------------------------------------------
QUAD = [
    "--task",
    "quadratics",
    "--algo",
    "relay",
    "--topology",
    "chain",
    "--lr",
    "0.05",
    "--dim",
    "4",
    "--seed",
    "2",
    "--backend",
    "local",
    "--workers",
    "2",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, steps",
    [
        # multiples of 4, then the last step
        (["--steps", "10", "--eval-every", "4"], [0, 4, 8, 10]),
        (["--steps", "8", "--eval-every", "4"], [0, 4, 8]),  # the last step is a multiple: once
        # eval-every beyond the run: first and last
        (["--steps", "3", "--eval-every", "5"], [0, 3]),
        # quadratics evaluate 200 times per run by default: every 401 // 200 = 2 steps, and step 401
        (["--steps", "401"], [*range(0, 401, 2), 401]),
    ],
)
def test_evaluated_steps(tmp_path, extra, steps):
    assert _main([*QUAD, *extra, "--out", tmp_path / "r.h5"]) == 0
    assert read_run(tmp_path / "r.h5").data["step"].tolist() == steps


def test_default_eval_cadence_is_one_epoch(tmp_path):
    # digits evaluates once per epoch: 3 steps (see DIGITS_TRAIN), so steps 0, 3, 6 and the last, 7
    assert (
        _main(
            [
                *DIGITS,
                "--algo",
                "relay",
                "--steps",
                "7",
                "--backend",
                "local",
                "--workers",
                "2",
                "--out",
                tmp_path / "r.h5",
            ]
        )
        == 0
    )
    run = read_run(tmp_path / "r.h5")
    assert run.data["step"].tolist() == [0, 3, 6, 7]
    np.testing.assert_allclose(run.data["epoch"], [0, 1, 2, 7 / 3], rtol=1e-12, atol=0)


@pytest.fixture
def saved_steps(monkeypatch):
    """The (rank, step) of every checkpoint the run writes."""
    saved: list[tuple[int, int]] = []
    original = checkpoint_files.save

    def record(directory, rank, step, state):
        saved.append((rank, step))
        original(directory, rank, step, state)

    monkeypatch.setattr(checkpoint_files, "save", record)
    return saved


@pytest.mark.parametrize(
    "extra, steps",
    [
        # never step 0 nor the finished step 10
        (["--eval-every", "4", "--checkpoint-every", "3"], [3, 6, 9]),
        (["--eval-every", "4"], [4, 8]),  # default: at the evaluations (not 0, not the end)
        # step 10 is the end: nothing to resume
        (["--eval-every", "5", "--checkpoint-every", "5"], [5]),
    ],
)
def test_checkpointed_steps(tmp_path, saved_steps, extra, steps):
    assert (
        _main(
            [
                *QUAD,
                "--steps",
                "10",
                *extra,
                "--checkpoint-dir",
                tmp_path / "ckpt",
                "--out",
                tmp_path / "r.h5",
            ]
        )
        == 0
    )
    assert sorted(saved_steps) == sorted((rank, s) for rank in range(2) for s in steps)


@pytest.mark.parametrize(
    "checkpoint_every, fail_at, resume_at",
    [
        # checkpoints at 3, 6; rows 0, 4 written; resumes at 6, which is no evaluation step
        (3, 7, 6),
        # checkpoint at 4, an evaluation: its row is dropped and written again after the resume
        (4, 5, 4),
    ],
)
def test_resumed_run_evaluates_where_an_uninterrupted_one_does(
    tmp_path, monkeypatch, checkpoint_every, fail_at, resume_at
):
    # eval every 4 over 10 steps: 0, 4, 8 and the last, 10
    args = [*QUAD, "--steps", "10", "--eval-every", "4", "--checkpoint-every", checkpoint_every]
    assert (
        _main([*args, "--out", tmp_path / "full.h5", "--checkpoint-dir", tmp_path / "ckpt-full"])
        == 0
    )
    resumed = [*args, "--out", tmp_path / "resumed.h5", "--checkpoint-dir", tmp_path / "ckpt"]
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", f"1:{fail_at}")
    assert _main(resumed) == train.EXIT_FAILED
    assert read_run(tmp_path / "resumed.h5").data["step"].tolist() == [0, 4]
    monkeypatch.delenv("RELAYMPI_INJECT_FAILURE")
    assert _main(resumed) == 0
    full, run = read_run(tmp_path / "full.h5"), read_run(tmp_path / "resumed.h5")
    # resumed_at_steps holds the last step kept from before the resume (docs/results.md)
    assert run.status == "completed" and list(run.attrs["resumed_at_steps"]) == [resume_at - 1]
    assert full.data["step"].tolist() == run.data["step"].tolist() == [0, 4, 8, 10]
    for key in ("epoch", "lr", "suboptimality", "consensus_distance", "bytes_sent"):
        np.testing.assert_array_equal(full.data[key], run.data[key], err_msg=key)


# -- 3. RelaySGD's lr correction ------------------------------------------------------------------
def _topology_cli(*args) -> str:
    proc = run_module("relaympi.topology", *args, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology, n, by_hand",
    [
        # 11/9: tests/test_topology.py::test_lr_correction_three_worker_chain_by_hand
        ("chain", 3, 11 / 9),
        # two workers relaying are exactly all-reduce: 1
        ("chain", 2, 1.0),
    ],
)
def test_lr_correction_is_what_the_topology_command_prints(tmp_path, topology, n, by_hand):
    factor = json.loads(_topology_cli(topology, "-n", str(n), "--json"))["lr_correction"]
    assert factor == pytest.approx(by_hand, rel=1e-12)
    printed = _topology_cli(topology, "-n", str(n))
    text = matched(r"RelaySGD lr correction\s+(\S+)", printed).group(1)
    assert float(text) == pytest.approx(factor, rel=1e-5)  # printed with 6 significant digits

    # lr 0.09, milestone at step 2 (quadratics: one step per epoch), no warm-up
    args = [
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        topology,
        "--lr",
        "0.09",
        "--dim",
        "4",
        "--seed",
        "1",
        "--steps",
        "3",
        "--eval-every",
        "1",
        "--milestones",
        "2",
        "--backend",
        "local",
        "--workers",
        str(n),
    ]
    assert _main([*args, "--out", tmp_path / "plain.h5"]) == 0
    assert _main([*args, "--relay-lr-correction", "--out", tmp_path / "corrected.h5"]) == 0
    plain, corrected = read_run(tmp_path / "plain.h5"), read_run(tmp_path / "corrected.h5")
    # without the flag: 0.09, 0.09, 0.009, 0.009; with it: each times the factor
    np.testing.assert_allclose(plain.data["lr"], [0.09, 0.09, 0.009, 0.009], rtol=1e-12, atol=0)
    np.testing.assert_allclose(
        corrected.data["lr"],
        [0.09 * factor, 0.09 * factor, 0.009 * factor, 0.009 * factor],
        rtol=1e-12,
        atol=0,
    )
    assert plain.config["lr_effective"] == pytest.approx(0.09, rel=1e-12)
    assert corrected.config["lr_effective"] == pytest.approx(0.09 * factor, rel=1e-12)
    assert corrected.config["relay_lr_correction"] is True and corrected.config["lr"] == 0.09


@pytest.mark.slow
def test_lr_correction_reaches_the_update(tmp_path):
    """The models of a corrected run are those of the matrix oracle stepped with lr * factor."""
    from relaympi.algorithms.matrix import make_matrix_algorithm
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import quadratics
    from relaympi.topology import build

    factor = json.loads(_topology_cli("chain", "-n", "3", "--json"))["lr_correction"]
    problem_file = tmp_path / "p.h5"
    quadratics.generate(3, quadratics.QuadraticsSpec(dim=4, zeta2=1.0, r0=5.0), seed=4).save(
        problem_file
    )
    assert (
        _main(
            [
                "--task",
                "quadratics",
                "--algo",
                "relay",
                "--topology",
                "chain",
                "--lr",
                "0.05",
                "--momentum",
                "0",
                "--relay-lr-correction",
                "--steps",
                "4",
                "--eval-every",
                "1",
                "--record-params",
                "--problem-file",
                problem_file,
                "--backend",
                "local",
                "--workers",
                "3",
                "--out",
                tmp_path / "r.h5",
            ]
        )
        == 0
    )
    params = read_run(tmp_path / "r.h5").data["params"]
    problem = quadratics.load(problem_file)
    engine = make_matrix_algorithm("relay", build("chain", 3), 3, np.zeros(4), OptimizerConfig())
    X = np.zeros((3, 4))
    for t in range(4):
        X = engine.step(X, problem.gradients(X), 0.05 * factor, t)
        np.testing.assert_allclose(params[t + 1], X, rtol=0, atol=1e-10)

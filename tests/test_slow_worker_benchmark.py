"""benchmarks.slow_worker: the messages a run was due to receive, its late drops over them, and the
cost table's figures of one run, from hand-made run files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import slow_worker
from relaympi.report.summary import ReportSettings, summarize
from relaympi.results import RunTopology, RunWriter, read_run
from tests.run_factories import make_config

# two trees of 4 workers (3 edges each) and a ring of 4 (4 edges)
TREES = (np.array([[0, 1], [0, 2], [1, 3]]), np.array([[0, 2], [1, 3], [2, 3]]))
RING = (np.array([[0, 1], [0, 3], [1, 2], [2, 3]]),)


def _run(
    path: Path,
    algo: str,
    edges: tuple[np.ndarray, ...],
    *,
    late: list[list[int]] | None = None,
    topology: str = "double-binary-trees",
) -> Path:
    """A completed digits run of 4 workers, evaluated at steps 0, 10, 20 (1 s apart, the worst
    worker at 0.2, 0.6, 0.9), with ``edges`` and, if given, ``late`` drops."""
    accuracy = np.array([[0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9], [0.9, 0.9, 0.95, 1.0]])
    config = make_config(task="digits", algo=algo, topology=topology, world_size=4)
    with RunWriter.create(path, config=config, provenance={}, world_size=4) as writer:
        writer.extend(
            {
                "step": np.array([0, 10, 20]),
                "epoch": np.array([0.0, 1.0, 2.0]),
                "time_s": np.array([0.0, 1.0, 2.0]),
                "test_accuracy": accuracy,
            }
        )
        writer.set_topology(
            RunTopology(topology, "ranks", np.zeros(4, dtype=np.int64), False, edges, (0,) * 2)
        )
        if late is not None:
            writer.add_late_drops(np.array(late, dtype=np.int64).reshape(-1, 5))
        writer.set_status("completed")
    return path


def test_messages_due_are_both_directions_of_every_edge_of_every_layer_each_step(
    tmp_path: Path,
) -> None:
    # 20 steps x 2 directions x (3 + 3) tree edges; a ring of 4: 20 x 2 x 4
    relay = read_run(_run(tmp_path / "relay.h5", "relay", TREES), datasets=["step"])
    assert slow_worker.messages_due(relay) == 240
    ring = _run(tmp_path / "ring.h5", "dpsgd", RING, topology="ring")
    assert slow_worker.messages_due(read_run(ring, datasets=["step"])) == 160
    allreduce = _run(tmp_path / "ar.h5", "allreduce", RING, topology="fully-connected")
    assert slow_worker.messages_due(read_run(allreduce, datasets=["step"])) is None
    sgp = read_run(_run(tmp_path / "sgp.h5", "sgp", RING), datasets=["step"])
    with pytest.raises(ValueError, match="cannot count"):
        slow_worker.messages_due(sgp)


def test_figures_are_the_late_drops_over_the_due_and_the_cost_tables_numbers(
    tmp_path: Path,
) -> None:
    # 3 late messages, 2 of them from worker 1 (the slow one), over 240 due
    late = [[3, 12, 0, 1, 0], [4, 16, 1, 1, 3], [9, 36, 0, 2, 0]]
    path = _run(tmp_path / "relay.h5", "relay", TREES, late=late)
    summary = summarize(read_run(path), ReportSettings())
    figures = slow_worker.run_figures(
        path,
        summary,
        0.5,
        condition="slow",
        round_=0,
        slow_rank=1,
        deadline=0.08,
        load=(1.0, 2.0),
    )
    assert (figures.late_drops, figures.late_from_slow, figures.due) == (3, 2, 240)
    assert figures.dropped_fraction == pytest.approx(3 / 240)
    # the worst worker first reaches 0.5 at the second evaluation (0.6), 1 s in
    assert figures.time_to_target_s == pytest.approx(1.0)
    # 1 s per 10 steps in both intervals: 100 ms/step
    assert figures.step_ms == pytest.approx(100.0)
    assert (figures.worst_final, figures.mean_final) == (0.9, pytest.approx(0.9375))
    assert slow_worker.table_lines([figures])[2] == (
        "| relay (double-binary-trees) | slow | 80 ms | 100.0 | 1.0 s | 90.0% | 93.8% "
        "| 3 / 240 (1.25%; 2 from the slow one) | 0 |"
    )
    never = slow_worker.run_figures(
        path, summary, 0.95, condition="slow", round_=0, slow_rank=1, deadline=None, load=(0, 0)
    )
    assert never.time_to_target_s is None
    clean = _run(tmp_path / "clean.h5", "relay", TREES)
    figures = slow_worker.run_figures(
        clean,
        summarize(read_run(clean), ReportSettings()),
        0.5,
        condition="clean",
        round_=0,
        slow_rank=1,
        deadline=None,
        load=(0, 0),
    )
    assert (figures.late_drops, figures.dropped_fraction, figures.due) == (None, None, 240)


def test_algos_parse_and_refuse_what_cannot_be_counted() -> None:
    assert slow_worker.parse_algos(slow_worker.DEFAULT_ALGOS) == [
        ("relay", None),
        ("dpsgd", "ring"),
        ("allreduce", None),
    ]
    for bad in ("d2", "relay,,dpsgd", "allreduce:ring", "dpsgd:one-peer-exponential"):
        with pytest.raises(ValueError, match="--algos"):
            slow_worker.parse_algos(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["--algos", "sgp"],
        ["--slow-rank", "16"],
        ["--deadline", "0"],
        ["--stop-ms", "100"],
        ["--", "--algo", "relay"],
    ],
)
def test_bad_input_is_refused_in_one_line_with_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        slow_worker.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err


FAKE_MPIRUN = """#!{python}
# mpirun -n N python -m relaympi.train FLAGS: records its flags, writes a run file of N workers
# (12 steps of 25 ms each, a ring's edges, one late drop under a deadline)
import json, sys
import numpy as np
from relaympi.results import RunTopology, RunWriter

n, flags = int(sys.argv[2]), sys.argv[6:]
with open({calls!r}, "a") as calls:
    calls.write(json.dumps(flags) + "\\n")
value = dict(zip(flags, flags[1:]))
config = {{"task": "digits", "algo": value["--algo"], "topology": value.get("--topology", "ring"),
          "alpha": 0.01, "lr": 0.1, "world_size": n, "seed": 0}}
ring = np.array(sorted((min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)))
with RunWriter.create(value["--out"], config=config, provenance={{}}, world_size=n,
                      overwrite=True) as writer:
    writer.extend({{"step": np.array([0, 12]), "epoch": np.array([0.0, 1.0]),
                   "time_s": np.array([0.0, 0.3]), "test_accuracy": np.full((2, n), 0.5)}})
    writer.set_topology(RunTopology(config["topology"], "ranks", np.zeros(n, dtype=np.int64),
                                    False, (ring,), (0,)))
    if "--message-deadline" in value:
        writer.add_late_drops(np.array([[3, 12, 0, 1, 0]]))
    writer.set_status("completed")
"""


@pytest.mark.slow
def test_each_algorithm_runs_clean_then_with_its_measured_deadline(tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    mpirun = tmp_path / "mpirun"
    mpirun.write_text(FAKE_MPIRUN.format(python=sys.executable, calls=str(calls)))
    mpirun.chmod(0o755)
    argv = ["--ranks", "4", "--algos", "relay,allreduce", "--out", str(tmp_path / "out")]
    assert slow_worker.main([*argv, "--mpirun", str(mpirun), "--", "--steps", "12"]) == 0
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    deadlines = [
        run[run.index("--message-deadline") + 1] if "--message-deadline" in run else None
        for run in runs
    ]
    # 25 ms per step clean: the deadline is twice that, for both relay runs after the clean one
    assert [run[run.index("--algo") + 1] for run in runs] == ["relay"] * 3 + ["allreduce"] * 2
    assert deadlines == [None, "0.05", "0.05", None, None]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["algo"], r["condition"]) for r in summary["runs"]] == [
        ("relay", "clean"),
        ("relay", "clean-deadline"),
        ("relay", "slow"),
        ("allreduce", "clean"),
        ("allreduce", "slow"),
    ]
    # 12 steps x 2 x 4 ring edges due; one late drop in each run under the deadline
    assert [r["dropped_fraction"] for r in summary["runs"]] == [None, 1 / 96, 1 / 96, None, None]

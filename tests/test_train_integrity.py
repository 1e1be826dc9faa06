"""The trainer never overwrites its inputs, records what ran, and turns misuse into exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaympi import train
from relaympi.config import ConfigError, parse_args
from relaympi.results import read_run
from relaympi.tasks import quadratics
from relaympi.training.plan import default_out, resolve
from relaympi.training.run_file import print_summary
from tests.conftest import matched

LOCAL = ["--backend", "local", "--workers", "2"]
QUAD = [*LOCAL, "--task", "quadratics", "--algo", "relay", "--topology", "chain", "--steps", "3"]


def run_main(args, capsys) -> tuple[int, str]:
    code = train.main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture
def problem_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.h5"
    quadratics.generate(2, quadratics.QuadraticsSpec(dim=5), seed=7).save(path)
    return path


# -- inputs are never overwritten -----------------------------------------------------------
def test_out_equal_to_problem_file_exits_2_and_keeps_the_problem(
    tmp_path, problem_file, capsys
) -> None:
    before = problem_file.read_bytes()
    code, err = run_main([*QUAD, "--problem-file", problem_file, "--out", problem_file], capsys)
    assert code == 2 and "--problem-file and --out are the same file" in err
    assert problem_file.read_bytes() == before


def test_save_problem_over_another_problem_exits_2_unless_overwrite(
    tmp_path, problem_file, capsys
) -> None:
    before = problem_file.read_bytes()
    code, err = run_main(
        [*QUAD, "--seed", "1", "--save-problem", problem_file, "--out", tmp_path / "r.h5"], capsys
    )
    assert (
        code == 2
        and f"--save-problem {problem_file} already exists" in err
        and "--overwrite" in err
    )
    assert problem_file.read_bytes() == before and not (tmp_path / "r.h5").exists()
    code, _ = run_main(
        [
            *QUAD,
            "--seed",
            "1",
            "--save-problem",
            problem_file,
            "--out",
            tmp_path / "r.h5",
            "--overwrite",
        ],
        capsys,
    )
    assert code == 0 and problem_file.read_bytes() != before


def test_save_problem_rerun_of_the_same_command_keeps_the_file(tmp_path, capsys) -> None:
    args = [
        *QUAD,
        "--save-problem",
        tmp_path / "p.h5",
        "--out",
        tmp_path / "r.h5",
        "--checkpoint-dir",
        tmp_path / "ck",
    ]
    assert run_main(args, capsys)[0] == 0
    before = (tmp_path / "p.h5").read_bytes()
    (tmp_path / "r.h5").unlink()
    assert run_main(args, capsys)[0] == 0  # the same problem again: nothing to refuse
    assert (tmp_path / "p.h5").read_bytes() == before


# -- default run-file names -------------------------------------------------------------------
def test_default_out_for_an_edge_list_is_a_plain_file_in_results(tmp_path) -> None:
    edges = tmp_path / "sub dir" / "chain.txt"
    edges.parent.mkdir()
    edges.write_text("0 1\n1 2\n2 3\n")
    cfg = parse_args([*LOCAL, "--workers", "4", "--topology", f"edge-list:{edges}"])
    plan = resolve(cfg, 4)
    out = default_out(plan.cfg, 4)
    assert out.parent == Path("results")
    assert (
        ":" not in out.name
        and "/" not in out.name
        and out.name.startswith("digits-relay-edge-list-chain-")
    )
    other = tmp_path / "chain.txt"
    other.write_text("0 1\n1 2\n2 3\n3 0\n")
    cfg = parse_args(
        [*LOCAL, "--workers", "4", "--topology", f"edge-list:{other}", "--algo", "dpsgd"]
    )
    other_out = default_out(resolve(cfg, 4).cfg, 4)
    digests = [matched(r"-chain-([0-9a-f]{8})-n4-", p.name).group(1) for p in (out, other_out)]
    assert digests[0] != digests[1]  # same stem, other content: other file


# -- the recorded config is what ran ----------------------------------------------------------
def test_problem_file_dimension_is_recorded(tmp_path, problem_file, capsys) -> None:
    code, _ = run_main([*QUAD, "--problem-file", problem_file, "--out", tmp_path / "r.h5"], capsys)
    assert code == 0
    config = read_run(tmp_path / "r.h5").config
    assert config["dim"] == 5 and config["mu"] is None and config["zeta2"] is None
    code, err = run_main(
        [*QUAD, "--dim", "10", "--problem-file", problem_file, "--out", tmp_path / "s.h5"], capsys
    )
    assert (
        code == 2
        and "--dim 10 conflicts with --problem-file" in err
        and not (tmp_path / "s.h5").exists()
    )
    code, err = run_main(
        [*QUAD, "--zeta2", "3", "--problem-file", problem_file, "--out", tmp_path / "s.h5"], capsys
    )
    assert code == 2 and "--zeta2 cannot apply" in err


def test_generated_problem_records_its_constants(tmp_path, capsys) -> None:
    assert run_main([*QUAD, "--dim", "4", "--out", tmp_path / "r.h5"], capsys)[0] == 0
    config = read_run(tmp_path / "r.h5").config
    assert (config["dim"], config["mu"], config["L"], config["relay_mode"]) == (
        4,
        0.5,
        1.0,
        "counts",
    )


# -- flags that cannot apply ----------------------------------------------------------------
@pytest.mark.parametrize(
    "args, flag",
    [
        (["--save-problem", "p.h5"], "--save-problem"),
        (["--record-params"], "--record-params"),
        (["--dim", "10"], "--dim"),
        (["--algo", "dpsgd", "--relay-mode", "previous"], "--relay-mode"),
        (["--algo", "relay", "--d2-exact-diffusion"], "--d2-exact-diffusion"),
        (["--data-dir", "."], "--data-dir"),
        (["--algo", "dpsgd", "--relay-lr-correction"], "--relay-lr-correction"),
    ],
)
def test_flags_that_cannot_apply_exit_2(args, flag, capsys) -> None:
    with pytest.raises(ConfigError, match=f"{flag} cannot apply"):
        parse_args([*LOCAL, "--task", "digits", *args])
    assert run_main([*LOCAL, "--task", "digits", *args], capsys)[0] == 2


def test_a_run_files_config_still_reruns_another_algorithm(tmp_path) -> None:
    """Old run files record every key (relay_mode, dim, ... with defaults): --config drops those
    that cannot apply."""
    old = {
        "task": "digits",
        "algo": "dpsgd",
        "relay_mode": "counts",
        "dim": 50,
        "mu": 0.5,
        "record_params": False,
        "world_size": 4,
    }
    (tmp_path / "c.json").write_text(json.dumps(old))
    cfg = parse_args(["--config", str(tmp_path / "c.json"), *LOCAL])
    assert cfg.relay_mode is None and cfg.dim is None and cfg.algo == "dpsgd"


def test_problem_and_generated_runs_agree(tmp_path, capsys) -> None:
    assert (
        run_main(
            [
                *QUAD,
                "--dim",
                "5",
                "--seed",
                "7",
                "--save-problem",
                tmp_path / "p.h5",
                "--out",
                tmp_path / "a.h5",
            ],
            capsys,
        )[0]
        == 0
    )
    assert (
        run_main([*QUAD, "--problem-file", tmp_path / "p.h5", "--out", tmp_path / "b.h5"], capsys)[
            0
        ]
        == 0
    )
    a, b = read_run(tmp_path / "a.h5"), read_run(tmp_path / "b.h5")
    np.testing.assert_array_equal(a.data["suboptimality"], b.data["suboptimality"])


# -- misuse is a clear exit 2 -----------------------------------------------------------------
def test_unknown_device_exits_2(tmp_path, capsys) -> None:
    code, err = run_main(
        [*LOCAL, "--steps", "1", "--device", "tpu", "--out", tmp_path / "r.h5"], capsys
    )
    assert code == 2 and "--device 'tpu'" in err and "cuda:N" in err and "Traceback" not in err


def test_unwritable_out_exits_2(tmp_path, capsys) -> None:
    code, err = run_main([*QUAD, "--out", "/proc/x.h5"], capsys)
    assert code == 2 and "/proc/x.h5" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_run_file_in_use_is_refused_and_untouched(tmp_path) -> None:
    from relaympi.results import RunWriter
    from tests.conftest import run_train

    out = tmp_path / "live.h5"
    with RunWriter.create(
        out, config={"task": "quadratics"}, provenance={}, world_size=2
    ) as writer:
        writer.extend({"step": np.array([0])})
        before = out.read_bytes()
        proc = run_train([*QUAD, "--out", out])
        assert proc.returncode == 2, proc.stderr
        assert (
            f"{out} is being written by another run" in proc.stderr
            and "Traceback" not in proc.stderr
        )
        assert out.read_bytes() == before


# -- one worker is the centralized baseline ---------------------------------------------------
def test_one_worker_allreduce_runs(tmp_path, capsys) -> None:
    code, err = run_main(
        [
            "--backend",
            "local",
            "--workers",
            "1",
            "--algo",
            "allreduce",
            "--steps",
            "3",
            "--out",
            tmp_path / "r.h5",
        ],
        capsys,
    )
    assert code == 0, err
    assert read_run(tmp_path / "r.h5").config["world_size"] == 1


# -- provenance and summaries -----------------------------------------------------------------
def test_provenance_command_reruns_the_module(tmp_path, capsys) -> None:
    out = tmp_path / "r.h5"
    assert run_main([*QUAD, "--out", out], capsys)[0] == 0
    command = read_run(out).provenance["command"]
    assert (
        command.startswith("python -m relaympi.train ")
        and "--backend local" in command
        and "train.py" not in command
    )


def _classification_run(path, accuracy, status="completed", num_classes=10):
    from tests import run_factories as rf

    rf.write_classification_run(path, accuracy, task="digits", status=status)
    if num_classes:
        import h5py

        with h5py.File(path, "a") as f:
            f.attrs["num_classes"] = num_classes
    return path


def test_preempted_summary_is_not_final(tmp_path, capsys) -> None:
    path = _classification_run(tmp_path / "p.h5", np.full((3, 2), 0.8), status="preempted")
    print_summary(path, "preempted")
    line = capsys.readouterr().out
    assert (
        "final" not in line.replace("not final", "")
        and "at step 300 (not final: preempted)" in line
    )


def test_summary_flags_a_worker_at_chance(tmp_path, capsys) -> None:
    acc = np.tile([0.9, 0.0975, 0.85], (6, 1))
    print_summary(_classification_run(tmp_path / "c.h5", acc), "completed")
    line = capsys.readouterr().out
    assert "WARNING: worker(s) 1 at chance accuracy" in line
    print_summary(_classification_run(tmp_path / "ok.h5", np.full((6, 3), 0.9)), "completed")
    assert "WARNING" not in capsys.readouterr().out


def test_default_lr_at_another_worker_count_warns() -> None:
    assert "tuned for 16 workers" in str(resolve(parse_args([*LOCAL]), 2).lr_warning)
    assert resolve(parse_args([*LOCAL, "--lr", "0.4"]), 2).lr_warning is None
    assert resolve(parse_args([*LOCAL]), 16).lr_warning is None


def test_help_describes_every_flag_topologies_and_exit_codes() -> None:
    from relaympi.config import build_parser
    from relaympi.topology import TOPOLOGY_NAMES

    parser = build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in TOPOLOGY_NAMES)
    assert (
        "exit status: 0 completed, 1 failed, 2 usage error" in text
        and "tuned for 16 workers" in text
    )


def test_log_lines_go_through_the_progress_bar() -> None:
    import io
    import logging

    from tqdm import tqdm

    stream = io.StringIO()
    bar = tqdm(total=10, file=stream, ncols=60, mininterval=0)
    bar.update(3)
    logger = logging.getLogger("relaympi.test_bar")
    handler = train.BarSafeHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("step 3/10 log line")
    finally:
        logger.removeHandler(handler)
        bar.close()
    text = stream.getvalue()
    before = text[: text.index("step 3/10 log line")]
    assert before.endswith(("\r", "\n")), repr(text)  # on a line of its own, not glued to the bar
    assert "step 3/10 log line\n" in text


# -- under mpirun ------------------------------------------------------------------------------
def _mpirun(n: int, args, tmp_path):
    from tests.conftest import run_train

    return run_train(args, mpi=n)


@pytest.mark.slow
@pytest.mark.mpirun
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--backend", "local", "--workers", "2"],
            "--backend local runs all workers in one process",
        ),
        (["--workers", "2"], "--workers is for --backend local"),
        (["--algo", "foo"], "invalid choice: 'foo'"),
        (["--task", "digits", "--dim", "10"], "--dim cannot apply"),
    ],
    ids=["backend-local", "workers", "argparse", "not-applicable"],
)
def test_usage_errors_print_once_under_mpirun(tmp_path, args, message) -> None:
    from tests.conftest import mpirun_path

    if mpirun_path() is None:
        pytest.skip("no mpirun")
    proc = _mpirun(2, [*args, "--steps", "2", "--out", tmp_path / "r.h5"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count(message) == 1, proc.stderr
    assert proc.stderr.count("error:") == 1


@pytest.mark.slow
@pytest.mark.mpirun
def test_mpirun_one_rank_allreduce_runs(tmp_path) -> None:
    from tests.conftest import mpirun_path

    if mpirun_path() is None:
        pytest.skip("no mpirun")
    proc = _mpirun(1, ["--algo", "allreduce", "--steps", "3", "--out", tmp_path / "r.h5"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_run(tmp_path / "r.h5").config["world_size"] == 1

"""`--config FILE`: a JSON object of flags or a run file; a bad value is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from relaympi.results import read_run
from tests.conftest import env_for_subprocess

# every test launches the trainer as a process (about 2 s each)
pytestmark = pytest.mark.slow

RUN = [
    "--task",
    "digits",
    "--backend",
    "local",
    "--workers",
    "4",
    "--steps",
    "6",
    "--eval-every",
    "3",
]


def train(args, cwd):
    cmd = [sys.executable, "-m", "relaympi.train", *map(str, args)]
    return subprocess.run(
        cmd, cwd=cwd, env=env_for_subprocess(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "values, words",
    [
        ({"steps": "five"}, ['"steps" is "five"', "an integer or null"]),
        ({"alpha": "0.1"}, ['"alpha" is "0.1"', "a number", "write 0.1 without quotes"]),
        ({"steps": "30"}, ['"steps" is "30"', "write 30 without quotes"]),
        ({"steps": 2.5}, ['"steps" is 2.5', "an integer"]),
        ({"steps": True}, ['"steps" is true', "an integer"]),
        ({"alpha": None}, ['"alpha" is null', "a number"]),
        ({"nesterov": "yes"}, ['"nesterov" is "yes"', "true or false"]),
        ({"task": 3}, ['"task" is 3', "one of quadratics, digits, cifar10"]),
        ({"milestones": 5}, ['"milestones" is 5', "a list of numbers"]),
        ({"out": 5}, ['"out" is 5', "a string"]),
        ({"extra": 1}, ['"extra" is 1', "a JSON object"]),
    ],
)
def test_a_bad_value_in_a_config_file_is_one_line_and_exit_2(tmp_path, values, words):
    (tmp_path / "c.json").write_text(json.dumps(values))
    proc = train(["--config", "c.json", "--backend", "local", "--workers", "4"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config c.json: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # nothing written


def test_a_file_that_is_neither_json_nor_a_run_file_is_one_line(tmp_path):
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)))
    proc = train(["--config", "noise.bin", *RUN], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "neither UTF-8 JSON nor a run file" in proc.stderr


def test_a_run_file_reruns_and_varies_its_run(tmp_path):
    """--config RUN.h5 reads the run's config: the same command reproduces its numbers, a flag on
    the command line varies it; the file's own --out is not reused (nor its --overwrite)."""
    first = tmp_path / "first.h5"
    assert (
        train(
            [*RUN, "--algo", "relay", "--alpha", "0.1", "--out", first, "--overwrite"], tmp_path
        ).returncode
        == 0
    )
    again = train(["--config", first, "--out", tmp_path / "again.h5"], tmp_path)
    assert again.returncode == 0, again.stderr
    varied = train(["--config", first, "--seed", "1"], tmp_path)
    assert varied.returncode == 0, varied.stderr
    (default,) = (tmp_path / "results").iterdir()  # the varied run's own default name
    assert default.name == "digits-relay-double-binary-trees-n4-a0.1-s1.h5"
    runs = {
        name: read_run(path)
        for name, path in (("first", first), ("again", tmp_path / "again.h5"), ("varied", default))
    }
    for key in ("step", "train_loss", "test_accuracy", "bytes_sent"):
        np.testing.assert_array_equal(runs["again"].data[key], runs["first"].data[key], err_msg=key)
    assert not np.array_equal(
        runs["varied"].data["train_loss"][1:], runs["first"].data["train_loss"][1:]
    )
    differ = {
        k for k in runs["first"].config if runs["first"].config[k] != runs["varied"].config[k]
    }
    assert differ == {"seed", "out", "overwrite"}
    assert runs["varied"].config["overwrite"] is False


def test_an_hdf5_file_that_is_not_a_run_file_is_refused(tmp_path):
    import h5py

    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.attrs["x"] = 1
    proc = train(["--config", "other.h5", *RUN], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "without a run's `config` attribute" in proc.stderr


def _foreign_run_file(path, config):
    import h5py

    with h5py.File(path, "w") as f:
        f.attrs["config"] = json.dumps(config)


def test_a_foreign_run_file_writes_nowhere_its_config_names(tmp_path):
    """--config RUN.h5 from someone else: the --save-problem path its config names is not
    created (nor an unrelated file there replaced with its --overwrite); a warning names it."""
    planted = tmp_path / "elsewhere" / "planted.h5"
    planted.parent.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    config = {"task": "quadratics", "algo": "relay", "save_problem": str(planted)}
    _foreign_run_file(tmp_path / "foreign.h5", config)
    _foreign_run_file(
        tmp_path / "clobber.h5", {**config, "save_problem": str(victim), "overwrite": True}
    )
    args = ["--backend", "local", "--workers", "2", "--steps", "2"]
    proc = train(["--config", "foreign.h5", "--out", "mine.h5", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "mine.h5").exists() and not planted.exists()
    (warning,) = [line for line in proc.stderr.splitlines() if line.startswith("warning: --config")]
    assert f'--save-problem "{planted}"' in warning
    proc = train(["--config", "clobber.h5", "--out", "again.h5", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "mine"


def test_a_run_file_config_gives_none_of_its_paths(tmp_path, capsys):
    """Every path-valued flag, and an edge-list topology (a file it reads), is dropped from a run
    file's config, each named once on one warning line; a JSON --config keeps them, and a path
    given on the command line is not warned about."""
    from relaympi.config import parse_args
    from relaympi.config.parser import RUN_FILE_PATH_KEYS

    assert {"save_problem", "problem_file", "data_dir", "model_dir", "out"} <= set(
        RUN_FILE_PATH_KEYS
    )
    paths = {
        "data_dir": str(tmp_path / "d\n\x1b[2Jx"),
        "model_dir": str(tmp_path / "m"),
        "problem_file": str(tmp_path / "p.h5"),
        "save_problem": str(tmp_path / "s.h5"),
    }
    config = {"task": "agnews", "algo": "dpsgd", "topology": "edge-list:/etc/passwd", **paths}
    _foreign_run_file(tmp_path / "foreign.h5", config)
    cfg = parse_args(["--config", str(tmp_path / "foreign.h5"), "--model-dir", str(tmp_path)])
    assert (cfg.data_dir, cfg.topology, cfg.problem_file, cfg.save_problem) == (None,) * 4
    assert cfg.model_dir == tmp_path  # given on the command line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, err
    for flag in ("--data-dir", "--topology", "--problem-file", "--save-problem"):
        assert err.count(flag) == 1, (flag, err)
    assert "--model-dir" not in err
    (tmp_path / "c.json").write_text(json.dumps({"task": "agnews", "data_dir": str(tmp_path)}))
    assert parse_args(["--config", str(tmp_path / "c.json")]).data_dir == tmp_path

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

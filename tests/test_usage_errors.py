"""A mistyped flag, choice or value is one line on stderr, exit 2: the reason, a "did you mean"
where a real name is close, and the command that shows the usage (under mpirun too)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from relaympi.entrypoint import UsageParser
from relaympi.results import run_status
from tests import run_factories as rf
from tests.conftest import ROOT, env_for_subprocess, mpirun, mpirun_path, requires_mpirun

# every test launches a command line as a process (about 2 s each)
pytestmark = pytest.mark.slow

TRAIN_HELP = " (see `python -m relaympi.train --help`)\n"


def _train(*args, launcher=()):
    proc = subprocess.run(
        [*launcher, sys.executable, "-m", "relaympi.train", *args],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr


# (the line's start, its end): argparse lists choices quoted before Python 3.12.8, bare since
@pytest.mark.parametrize(
    "args, start, end",
    [
        (
            ["--algo", "relya"],
            "error: argument --algo: invalid choice: 'relya' (choose from ",
            "isolated'); did you mean 'relay'?",
        ),
        (
            ["--wokers", "3"],
            "error: unrecognized arguments: --wokers 3",
            "; did you mean --workers?",
        ),
        (["--lr", "abc"], "error: argument --lr: invalid float value: 'abc'", "'abc'"),
        (
            ["--task", "digts"],
            "error: argument --task: invalid choice: 'digts' (choose from ",
            "agnews'); did you mean 'digits'?",
        ),
        (
            ["--workers=3", "--no-overlpa"],
            "error: unrecognized arguments: --no-overlpa",
            "; did you mean --no-overlap?",
        ),
        (["--zzz"], "error: unrecognized arguments: --zzz", "--zzz"),  # nothing close: no guess
    ],
    ids=["algo", "flag", "value", "task", "negated-flag", "no-guess"],
)
def test_a_usage_error_is_one_line(args, start, end):
    code, err = _train(*args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(start), err
    assert (
        err.replace("isolated)", "isolated')")
        .replace("agnews)", "agnews')")
        .endswith(end + TRAIN_HELP)
    ), err


@requires_mpirun
def test_under_mpirun_rank_zero_prints_the_one_line():
    code, err = _train("--algo", "relya", launcher=(mpirun_path(), "-n", "2"))
    assert code == 2
    assert err.count("error:") == 1 and err.count("\n") == 1, err
    assert "did you mean 'relay'?" in err and "usage:" not in err


def test_every_usage_parser_answers_so(capsys):
    parser = UsageParser(prog="python -m tool")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    sub.add_parser("fetch").add_argument("--root")
    for argv, line in [
        (
            ["fecth"],
            "error: argument command: invalid choice: 'fecth' (choose from fetch); "
            "did you mean 'fetch'?",
        ),
        (["fetch", "--rot", "x"], "error: unrecognized arguments: --rot x; did you mean --root?"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.replace("'fetch')", "fetch)")  # quoted before Python 3.12.8
        assert err == line + " (see `python -m tool --help`)\n"


# -- a bad --out is refused before torch loads ---------------------------------------------------
_REFUSALS = """
import json, sys
from relaympi import train
codes = [train.main(args) for args in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""


def test_a_bad_out_is_refused_before_torch_loads(tmp_path):
    """Under mpirun every rank imports torch (80 s with 16 ranks on one node): the refusals of a
    missing folder, a name without .h5 and a finished run come first, in one line each."""
    finished = rf.write_classification_run(tmp_path / "done.h5", np.full((3, 2), 0.5))
    outs = [tmp_path / "nodir" / "r.h5", tmp_path / "notes.txt", finished]
    runs = [
        ["--task", "digits", "--backend", "local", "--workers", "2", "--out", str(out)]
        for out in outs
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _REFUSALS, json.dumps(runs)],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(proc.stdout) == {"codes": [2, 2, 2], "torch": False}, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: output directory {tmp_path / 'nodir'} does not exist (for --out {outs[0]}); "
        "create it first",
        f"error: --out {outs[1]} must end in .h5 (a run file is HDF5, and the report reads *.h5 "
        f"files), such as {tmp_path / 'notes.h5'}",
        f"error: {finished} already holds a finished run; pass --overwrite to replace it",
    ]
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "notes.txt").exists()
    assert run_status(finished) == "completed"


# -- every other misuse is refused before torch loads too ------------------------------------------
_MISUSE = """
import json, sys
from relaympi import train
codes = []
for args in json.loads(sys.argv[1]):
    try:
        codes.append(train.main(args))
    except SystemExit as exc:  # argparse's refusals exit from inside main
        codes.append(exc.code)
    print("--", file=sys.stderr)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""

# (the flags after --task digits --backend local --workers 4, the one line that refuses them)
MISUSE = [
    (
        ["--lrr", "0.1"],
        "error: unrecognized arguments: --lrr 0.1; did you mean --lr?" + TRAIN_HELP.rstrip(),
    ),
    (
        ["--algo", "relya"],
        "error: argument --algo: invalid choice: 'relya' (choose from allreduce, relay, "
        "relay-grad, dpsgd, qgm, d2, gt, sgp, isolated); did you mean 'relay'?"
        + TRAIN_HELP.rstrip(),
    ),
    (
        ["--topology", "rnig"],
        "error: unknown topology 'rnig' (did you mean 'ring'?); choose one of ring, chain, star, "
        "binary-tree, double-binary-trees, fully-connected, hypercube, social-network, "
        "social-network-tree, exponential, one-peer-exponential, alternating-ring, "
        "spanning-tree:<name> or edge-list:<file>",
    ),
    (["--lr", "-1"], "error: --lr must be > 0, got -1.0"),
    (
        ["--optimizer", "foo"],
        "error: argument --optimizer: invalid choice: 'foo' (choose from sgd, adam)"
        + TRAIN_HELP.rstrip(),
    ),
    (["--momentum", "1.5"], "error: --momentum must be in [0, 1), got 1.5"),
    (["--drop-prob", "2"], "error: --drop-prob must be in [0, 1), got 2.0"),
    (
        ["--algo", "isolated", "--drop-prob", "0.5"],
        "error: --drop-prob cannot apply: isolated sends no messages (nothing would be dropped)",
    ),
]


def test_misuse_is_refused_before_torch_loads():
    """A mistyped flag, an unknown name, a value out of range and a flag that cannot apply: each
    one line, exit 2, and torch never imported (each rank of `mpirun -n 16` would wait for it)."""
    runs = [["--task", "digits", "--backend", "local", "--workers", "4", *a] for a, _ in MISUSE]
    proc = subprocess.run(
        [sys.executable, "-c", _MISUSE, json.dumps(runs)],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(proc.stdout) == {"codes": [2] * len(MISUSE), "torch": False}, proc.stderr
    said = proc.stderr.replace("'sgd', 'adam'", "sgd, adam")  # quoted before Python 3.12.8
    said = said.replace(
        "'allreduce', 'relay', 'relay-grad', 'dpsgd', 'qgm', 'd2', 'gt', 'sgp', 'isolated'",
        "allreduce, relay, relay-grad, dpsgd, qgm, d2, gt, sgp, isolated",
    )
    assert said.split("\n--\n")[:-1] == [line for _, line in MISUSE]


def _said_under_mpirun(*args: str, ranks: int = 2) -> str:
    """``train ARGS`` under ``mpirun -n RANKS``: it must exit 2 with no rank importing torch; what
    it printed besides the import times. The ranks' stderr reach mpirun's as one stream, so a
    rank's import-time line can land inside another's error line: each import-time record is cut
    out wherever it falls."""
    proc = subprocess.run(
        [mpirun(), "-n", str(ranks), sys.executable, "-X", "importtime", "-m", "relaympi.train"]
        + ["--task", "digits", *args],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    record = re.compile(r"import time:[^|\n]*\|[^|\n]*\|[^\n]*?(?:\n|$)")
    imports = record.findall(err)
    assert imports and not [line for line in imports if line.split("|")[-1].strip() == "torch"]
    return record.sub("", err)


@requires_mpirun
def test_under_mpirun_a_mistyped_value_is_refused_before_any_rank_loads_torch():
    assert _said_under_mpirun("--lr", "-1") == "error: --lr must be > 0, got -1.0\n"


@requires_mpirun
def test_under_mpirun_a_finished_run_is_refused_before_any_rank_loads_torch(tmp_path):
    finished = rf.write_classification_run(tmp_path / "done.h5", np.full((3, 2), 0.5))
    assert _said_under_mpirun("--out", str(finished)) == (
        f"error: {finished} already holds a finished run; pass --overwrite to replace it\n"
    )


@requires_mpirun
def test_under_mpirun_a_topology_the_rank_count_cannot_build_is_refused_before_torch():
    """SGP's exponential schedule on 3 ranks: every rank finds it before torch, rank 0 says it."""
    assert _said_under_mpirun("--algo", "sgp", ranks=3) == (
        "error: topology 'exponential' with 3 workers: the exponential schedule needs a power of "
        "two world_size (2, 4, 8, 16, ...), got 3\n"
    )


# -- --help, and a topology the worker count cannot build, need no torch either -------------------
_TORCH_FREE = """
import json, sys
from relaympi import train
try:
    code = train.main(sys.argv[1:])
except SystemExit as exc:  # --help exits from inside the parser
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def _torch_free(*args: str) -> tuple[dict, str, str]:
    """``train.main(ARGS)`` in a fresh process: its exit status and whether it imported torch, what
    it printed to stdout, and its stderr without that last line."""
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, *args],
        cwd=ROOT,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    *said, last = proc.stderr.splitlines()
    return json.loads(last), proc.stdout, "\n".join(said)


def test_help_imports_no_torch():
    """--help shows every task's and algorithm's defaults (the tasks' defaults, the default
    topologies, the algorithms that need momentum) from their torch-free declarations."""
    status, out, err = _torch_free("--help")
    assert status == {"code": 0, "torch": False}, err
    text = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(out.split()))  # lines wrap after a hyphen
    assert (
        "Default per algorithm: allreduce/isolated fully-connected, relay/relay-grad "
        "double-binary-trees, dpsgd/qgm/d2/gt ring, sgp exponential; task agnews: relay chain"
    ) in text
    assert (
        "samples per worker per step; task default: quadratics 1, digits 8, cifar10 32, "
        "imagenet 32, agnews 32"
    ) in text
    assert "agnews 0 (--algo qgm: 0.9 where that is 0)" in text


def test_a_topology_the_worker_count_cannot_build_is_refused_before_torch():
    """SGP's exponential schedule on 6 workers, and RelaySGD's trees on one: one line, exit 2, no
    torch; a run that may resume the survivors of a larger run (--checkpoint-dir) is left to the
    plan, which refuses the same count with the same line."""
    base = ["--task", "quadratics", "--steps", "2", "--backend", "local"]
    status, _, err = _torch_free(*base, "--workers", "6", "--algo", "sgp")
    assert status == {"code": 2, "torch": False}
    assert err == (
        "error: topology 'exponential' with 6 workers: the exponential schedule needs a power of "
        "two world_size (2, 4, 8, 16, ...), got 6"
    )
    status, _, err = _torch_free(*base, "--workers", "1")
    assert status == {"code": 2, "torch": False}
    assert err == (
        "error: topology 'double-binary-trees' with 1 workers: double-binary-trees world_size "
        "must be >= 2, got 1; one worker is the centralized baseline: --algo allreduce"
    )

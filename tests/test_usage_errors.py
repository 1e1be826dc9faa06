"""A mistyped flag, choice or value is one line on stderr, exit 2: the reason, a "did you mean"
where a real name is close, and the command that shows the usage (under mpirun too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relaympi.entrypoint import UsageParser
from tests.conftest import ROOT, env_for_subprocess, mpirun_path, requires_mpirun

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
            "relay-grad'); did you mean 'relay'?",
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
        err.replace("relay-grad)", "relay-grad')")
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

"""Two cluster/local_cluster.sh clusters side by side: a second beside the suite's (marker cluster).

Needs the suite's cluster (as tests/test_slurm.py) and root to start the second one.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import matched
from tests.test_slurm import bash, clean_env, cluster  # noqa: F401 - cluster: the suite's cluster, a fixture


def slurm(conf: str | None, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A SLURM client command against the cluster of ``conf`` (None: the suite's, as the environment
    says)."""
    env = clean_env()
    if conf is not None:
        env["SLURM_CONF"] = conf
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout)


def ctld_port(conf: str | None) -> int:
    proc = slurm(conf, "scontrol", "show", "config")
    assert proc.returncode == 0, proc.stderr
    return int(matched(r"^SlurmctldPort\s*=\s*(\d+)", proc.stdout, re.MULTILINE).group(1))


def daemons_running(folder: Path) -> list[str]:
    running = []
    for daemon in ("slurmctld", "slurmd"):
        pid_file = folder / f"{daemon}.pid"
        if pid_file.is_file() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
            running.append(daemon)
    return running


@pytest.fixture
def second(cluster: None, tmp_path: Path):  # noqa: F811 - the imported fixture
    """A second cluster in its own folder, on ports it picks; stopped afterwards."""
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip(
            "a second local cluster needs root and slurmctld (bash "
            "cluster/local_cluster.sh install)"
        )
    folder = tmp_path / "second cluster"
    proc = bash("cluster/local_cluster.sh", "start", "--dir", str(folder))
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # one line that scripts eval (scripts/test.sh does), right for a folder with a space in
        # its name
        assert len(proc.stdout.splitlines()) == 1
        evaluated = subprocess.run(
            ["bash", "-c", 'eval "$1" && printf %s "$SLURM_CONF"', "-", proc.stdout],
            capture_output=True,
            text=True,
        )
        assert evaluated.stdout == str(folder / "slurm.conf")
        yield folder
    finally:
        stop = bash("cluster/local_cluster.sh", "stop", "--dir", str(folder))
        assert stop.returncode == 0, stop.stderr
        assert not daemons_running(folder)


@pytest.mark.cluster
def test_a_second_cluster_runs_beside_the_suites_and_stops_alone(second: Path) -> None:
    first_conf, second_conf = os.environ.get("SLURM_CONF"), str(second / "slurm.conf")
    assert ctld_port(first_conf) != ctld_port(second_conf)
    for conf in (first_conf, second_conf):
        proc = slurm(conf, "srun", "-N", "1", "-n", "1", "hostname")
        assert (proc.returncode, proc.stdout.strip()) == (0, socket.gethostname()), proc.stderr
        out = second / f"job-{ctld_port(conf)}.out"
        proc = slurm(
            conf,
            "sbatch",
            "--wait",
            "-o",
            str(out),
            "--wrap",
            "echo $SLURM_JOB_ID on $SLURM_SUBMIT_HOST",
        )
        assert proc.returncode == 0, proc.stderr
        job = matched(r"Submitted batch job (\d+)", proc.stdout).group(1)
        assert out.read_text() == f"{job} on {socket.gethostname()}\n"
    # each cluster sees its own queue only
    name = f"relaympi-second-{os.getpid()}"
    proc = slurm(
        second_conf, "sbatch", "--parsable", "-J", name, "-o", "/dev/null", "--wrap", "sleep 120"
    )
    assert proc.returncode == 0, proc.stderr
    try:
        assert name in slurm(second_conf, "squeue", "-h", "-o", "%j").stdout
        assert name not in slurm(first_conf, "squeue", "-h", "-o", "%j").stdout
    finally:
        slurm(second_conf, "scancel", proc.stdout.strip().split(";")[0])
    assert sorted(daemons_running(second)) == ["slurmctld", "slurmd"]
    stop = bash("cluster/local_cluster.sh", "stop", "--dir", str(second))
    assert stop.returncode == 0, stop.stderr
    assert not daemons_running(second)
    # the suite's cluster (and the munged it shares) still runs
    proc = slurm(first_conf, "srun", "-N", "1", "-n", "1", "hostname")
    assert (proc.returncode, proc.stdout.strip()) == (0, socket.gethostname()), proc.stderr


def test_bad_options_exit_2_with_the_usage(tmp_path: Path) -> None:
    for args, message in [
        (["start", "--ctld-port", "80"], "a port must be a number in 1024-65535, got '80'"),
        (
            ["start", "--ctld-port", "7000", "--slurmd-port", "7000"],
            "--ctld-port and --slurmd-port must differ",
        ),
        (["status", "--dri", str(tmp_path)], "unknown option --dri"),
        (["status", "--dir"], "--dir needs a value"),
        (["restart"], "unknown command 'restart'"),
    ]:
        proc = bash("cluster/local_cluster.sh", *args)
        assert proc.returncode == 2 and message in proc.stderr and "usage:" in proc.stderr, (
            args,
            proc.stderr,
        )


@pytest.mark.parametrize(
    "args", [["--help"], ["-h"], ["help"], ["start", "--nodes", "2", "--help"], ["link", "-h"]]
)
def test_help_prints_the_usage_and_exits_0(args: list[str]) -> None:
    proc = bash("cluster/local_cluster.sh", *args)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: ")
    assert "--nodes N" in proc.stdout and "--dir DIR" in proc.stdout


@pytest.mark.parametrize("part", ["slurm.sh", "nodes.sh"])
def test_the_two_parts_are_not_run_on_their_own(part: str) -> None:
    proc = bash(f"cluster/{part}", "start")
    assert proc.returncode == 2 and "run that" in proc.stderr and proc.stdout == "", proc.stderr

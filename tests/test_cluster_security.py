"""The cluster tool as root trusts no folder it did not make (cluster/local_cluster.sh), and the
sweeps run no prelude from a settings file another user may write (jobs/lib.sh).

Fast: SLURM's daemons and munge are stand-in scripts on PATH that only note their arguments, so
nothing is installed or started; an old tool that went through a planted folder would run them,
write through its links and signal its pids, which is what these tests look for.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_slurm import ROOT, clean_env

TOOL = ROOT / "cluster" / "local_cluster.sh"
NOBODY = 65534  # another user's uid: no account needed to own a folder

as_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="the cluster tool's folder checks are for root (chown, root's folders)",
)

# stand-ins that note how they were run; sinfo reports the node idle, munge always works
STUBS = {
    "slurmctld": "",
    "slurmd": "",
    "scontrol": "",
    "sinfo": "echo idle",
    "munge": "echo credential",
    "unmunge": "cat >/dev/null",
}


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    """A folder of stand-in SLURM and munge commands; each appends its command line to
    ``ran.log`` beside it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, body in STUBS.items():
        script = folder / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >>"$STUB_LOG"\n{body}\n')
        script.chmod(0o755)
    return folder


def tool(stubs: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env(STUB_LOG=str(stubs / "ran.log"))
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", str(TOOL), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


def ran(stubs: Path) -> str:
    log = stubs / "ran.log"
    return log.read_text() if log.exists() else ""


def planted(tmp_path: Path) -> Path:
    """A folder another user (uid 65534) made: root must not read, run or write through it."""
    folder = tmp_path / "planted"
    folder.mkdir(mode=0o755)
    return folder


def hand_over(folder: Path) -> None:
    for path in (folder, *folder.iterdir()):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


def assert_refused(proc: subprocess.CompletedProcess, folder: Path, why: str) -> None:
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert str(folder) in proc.stderr and why in proc.stderr, proc.stderr


@pytest.fixture
def bystanders(tmp_path: Path) -> Iterator[list[subprocess.Popen]]:
    """Two live processes a pid file may name: a sleep, and a sleep whose name is slurmctld."""
    named = tmp_path / "slurmctld"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", named)
    procs = [subprocess.Popen(["sleep", "300"]), subprocess.Popen([str(named), "300"])]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def alive(procs: list[subprocess.Popen]) -> list[bool]:
    return [proc.poll() is None for proc in procs]


@as_root
@pytest.mark.parametrize("command", ["status", "start", "stop", "link"])
def test_a_planted_nodes_env_is_never_run(tmp_path: Path, stubs: Path, command: str) -> None:
    folder, marker = planted(tmp_path), tmp_path / "marker"
    (folder / "nodes.env").write_text(f"N_NODES=$(touch {shlex.quote(str(marker))})\nN_TAG=1\n")
    hand_over(folder)
    args = [command, "100mbit"] if command == "link" else [command]
    proc = tool(stubs, *args, "--dir", str(folder))
    assert not marker.exists()
    if command == "link":  # needs namespaces first, which a container may refuse: exit 2 either way
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    else:
        assert_refused(proc, folder, "owned by uid 65534")
    assert ran(stubs) == ""


@as_root
def test_a_planted_conf_link_is_never_written_through(tmp_path: Path, stubs: Path) -> None:
    folder, victim = planted(tmp_path), tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / "slurm.conf").symlink_to(victim)
    hand_over(folder)
    proc = tool(stubs, "start", "--dir", str(folder))
    assert victim.read_text() == "precious\n"
    assert_refused(proc, folder, "owned by uid 65534")
    assert ran(stubs) == ""


@as_root
def test_a_planted_pid_file_kills_nothing(
    tmp_path: Path, stubs: Path, bystanders: list[subprocess.Popen]
) -> None:
    folder = planted(tmp_path)
    (folder / "slurm.conf").write_text("ClusterName=theirs\n")
    (folder / "slurmctld.pid").write_text(f"{bystanders[0].pid}\n")
    (folder / "slurmd.pid").write_text(f"{bystanders[1].pid}\n")
    hand_over(folder)
    for command in ("stop", "status", "start"):
        proc = tool(stubs, command, "--dir", str(folder))
        assert alive(bystanders) == [True, True]
        assert_refused(proc, folder, "owned by uid 65534")
    assert ran(stubs) == ""


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_may_write_is_refused(tmp_path: Path, stubs: Path, mode: int) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    (folder / "nodes.env").write_text("N_NODES=2\n")
    proc = tool(stubs, "status", "--dir", str(folder))
    assert_refused(proc, folder, "writable by group or others")
    # and a folder of root's inside one that others may write (and rename it in): refused too
    inner = folder / "inner"
    inner.mkdir(mode=0o700)
    proc = tool(stubs, "start", "--dir", str(inner))
    assert_refused(proc, inner, f"lies in {folder}")
    assert ran(stubs) == ""


@as_root
def test_a_nodes_env_is_read_as_checked_lines(tmp_path: Path, stubs: Path) -> None:
    """Even in a folder of root's, nodes.env is data: a line this tool never writes is refused."""
    folder, marker = tmp_path / "ours", tmp_path / "marker"
    folder.mkdir(mode=0o700)
    for line in (f"N_NODES=$(touch {marker})", f"PATH=/nowhere;touch {marker}", "N_CPUS=0"):
        (folder / "nodes.env").write_text(f"{line}\nN_SUBNET=10.213.7\n")
        proc = tool(stubs, "status", "--dir", str(folder))
        assert_refused(proc, folder / "nodes.env", "is not one this script writes")
        assert shlex.quote(line) in proc.stderr or line.split("=")[0] in proc.stderr
        assert not marker.exists()


@as_root
def test_a_link_in_roots_own_folder_is_not_written_through(tmp_path: Path, stubs: Path) -> None:
    folder, victim = tmp_path / "ours", tmp_path / "victim"
    folder.mkdir(mode=0o700)
    victim.write_text("precious\n")
    for name in ("slurm.conf", "nodes.env", "launcher", "slurmd.pid"):
        (folder / name).symlink_to(victim)
        proc = tool(stubs, "start", "--dir", str(folder))
        assert_refused(proc, folder, f"holds {name} as a symbolic link")
        (folder / name).unlink()
    assert victim.read_text() == "precious\n"
    assert ran(stubs) == ""


@as_root
def test_stop_signals_only_its_own_daemons(
    tmp_path: Path, stubs: Path, bystanders: list[subprocess.Popen]
) -> None:
    """Pid files of root's own folder that name a sleep, and a process called slurmctld started
    without this cluster's conf: neither is this cluster's daemon, and stop leaves both alone."""
    folder = tmp_path / "ours"
    folder.mkdir(mode=0o700)
    (folder / "slurm.conf").write_text("ClusterName=relaympi\n")
    (folder / "slurmctld.pid").write_text(f"{bystanders[1].pid}\n")
    (folder / "slurmd.pid").write_text(f"{bystanders[0].pid}\n")
    proc = tool(stubs, "stop", "--dir", str(folder))
    assert alive(bystanders) == [True, True]
    assert proc.returncode == 0, proc.stderr
    assert ran(stubs).splitlines() == ["scontrol shutdown"]


@as_root
def test_start_makes_a_folder_of_roots_alone_and_names_the_conf(
    tmp_path: Path, stubs: Path
) -> None:
    folder = tmp_path / "made" / "cluster"
    proc = tool(stubs, "start", "--dir", str(folder))
    assert proc.returncode == 0, proc.stderr
    for made in (folder, folder.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == 0
    conf = folder / "slurm.conf"
    assert conf.is_file() and not conf.is_symlink() and "SlurmctldPort=" in conf.read_text()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp file left
    # the daemons are started with the conf on their command line: how stop and status know them
    daemons = [
        line for line in ran(stubs).splitlines() if line.split()[0] in ("slurmctld", "slurmd")
    ]
    assert daemons == [f"slurmctld -f {conf}", f"slurmd -f {conf}"]


@as_root
def test_a_new_folder_in_a_sticky_shared_folder_is_made(tmp_path: Path, stubs: Path) -> None:
    """A state folder that does not exist yet, in a sticky folder every user may write (/tmp): the
    sticky folder holds it safely and is not itself taken for the state folder. (A test's folder
    that an earlier stop removed is made again this way.)"""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    folder = shared / "cluster"
    proc = tool(stubs, "start", "--dir", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == 0
    # without the sticky bit, others could rename the new folder away: refused, nothing made
    other = tmp_path / "open"
    other.mkdir()
    other.chmod(0o777)
    proc = tool(stubs, "start", "--dir", str(other / "cluster"))
    assert_refused(proc, other / "cluster", f"lies in {other}")
    assert not (other / "cluster").exists()


def test_the_munge_key_is_never_readable_by_others(tmp_path: Path) -> None:
    """Made under umask 077: even before its chmod (a no-op here) only its owner may read it."""
    key = tmp_path / "etc" / "munge" / "munge.key"
    script = (
        f"source {shlex.quote(str(ROOT / 'cluster' / 'slurm.sh'))}; "
        f"MUNGE_KEY={shlex.quote(str(key))}; chown() {{ :; }}; chmod() {{ :; }}; umask 022; "
        "make_munge_key"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == 1024


def sweep_setup(config: Path, **settings: str) -> subprocess.CompletedProcess:
    probe = f"source {shlex.quote(str(ROOT / 'jobs' / 'lib.sh'))}; relaympi_setup"
    env = clean_env(RELAYMPI_JOBS_CONFIG=str(config), **settings)
    return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("owner, mode", [(None, 0o664), (None, 0o646), (NOBODY, 0o644)])
def test_a_prelude_from_a_settings_file_others_may_write_is_refused(
    tmp_path: Path, owner: int | None, mode: int
) -> None:
    if owner is not None and os.geteuid() != 0:
        pytest.skip("a file of another user's needs root to make (chown)")
    marker, config = tmp_path / "marker", tmp_path / "site.env"
    config.write_text(f"RELAYMPI_PRELUDE=touch {shlex.quote(str(marker))}\n")
    config.chmod(mode)
    if owner is not None:
        os.chown(config, owner, owner)
    proc = sweep_setup(config)
    assert proc.returncode != 0 and not marker.exists()
    assert len(proc.stderr.splitlines()) == 1 and str(config) in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_prelude_from_the_owners_own_settings_file_runs(tmp_path: Path) -> None:
    marker, config = tmp_path / "marker", tmp_path / "site.env"
    config.write_text(f"RELAYMPI_PRELUDE=touch {shlex.quote(str(marker))}\n")
    config.chmod(0o644)
    proc = sweep_setup(config)
    assert proc.returncode == 0 and marker.exists(), proc.stderr

"""Emulated multi-node clusters: ``cluster/local_cluster.sh start --nodes N`` (marker cluster;
root).

One 2-node cluster (a network namespace and a hostname per node, tbf-shaped links) serves the
module: started by the ``nodes`` fixture in a folder of its own, on ports and a subnet it picks
(beside the suite's one-node cluster, if that runs), and stopped at the end, which must leave no
namespace, link, daemon or file. Without root, namespaces or SLURM the tests skip with the reason.
"""

# Long module: the emulated multi-node cluster, started once for all its tests

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi.results import read_run, run_status
from tests.conftest import matched, requires_ulfm
from tests.test_slurm import ROOT, bash, clean_env
from tests.test_ulfm_mpi import SURVIVE, records

pytestmark = pytest.mark.cluster

CLUSTER_TOOL = ROOT / "cluster" / "local_cluster.sh"

# one configuration for every run here: ~3 s of training, a checkpoint every 50 steps
TRAIN = [
    "--task",
    "digits",
    "--algo",
    "relay",
    "--alpha",
    "0.01",
    "--steps",
    "300",
    "--eval-every",
    "50",
    "--log-every",
    "50",
]


def _skip_reason() -> str | None:
    if os.environ.get("RELAYMPI_TEST_SLURM") == "0":
        return "RELAYMPI_TEST_SLURM=0: no SLURM tests"
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces, tc)"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated nodes need {tool} (bash cluster/local_cluster.sh install; iproute2)"
    if subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True).returncode != 0:
        return "this machine refuses network namespaces"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    return None


def parse_exports(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        assert words and words[0] == "export", line
        env.update((name, value) for name, value in (w.split("=", 1) for w in words[1:]))
    return env


class Nodes:
    def __init__(self, folder: Path, exports: dict[str, str]):
        self.folder = folder
        self.exports = exports
        record = dict(
            line.split("=", 1) for line in (folder / "nodes.env").read_text().splitlines()
        )
        self.tag, self.iface = record["N_TAG"], record["N_IFACE"]

    def env(self, **extra: str) -> dict[str, str]:
        return {**clean_env(), **self.exports, **extra}

    def run(self, *args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            env=self.env(),
            cwd=ROOT,
            timeout=timeout,
            **kwargs,
        )

    def ns(self, node: int) -> str:
        return f"rmpi{self.tag}-node{node}"

    def veth(self, node: int) -> str:
        return f"rmpi{self.tag}n{node}"

    def sent_bytes(self, node: int) -> tuple[int, int]:
        """Bytes the tbf qdiscs of NODE's link have sent: (into the node, out of it)."""
        into = subprocess.run(
            ["tc", "-s", "qdisc", "show", "dev", self.veth(node)], capture_output=True, text=True
        ).stdout
        out = subprocess.run(
            ["tc", "-n", self.ns(node), "-s", "qdisc", "show", "dev", self.iface],
            capture_output=True,
            text=True,
        ).stdout
        sent = [int(matched(r"Sent (\d+) bytes", text).group(1)) for text in (into, out)]
        return sent[0], sent[1]

    def cluster(self, *args: str) -> subprocess.CompletedProcess:
        return bash("cluster/local_cluster.sh", *args, "--dir", str(self.folder))


def leftovers(tag: str, folder: Path) -> list[str]:
    found = [
        ns
        for ns in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.split()
        if ns.startswith(f"rmpi{tag}-")
    ]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += re.findall(rf"^\d+: (rmpi{tag}[^:@ ]*)", links, re.MULTILINE)
    found += [
        f"process {line}"
        for line in subprocess.run(
            ["ps", "-eo", "pid=,args="], capture_output=True, text=True
        ).stdout.splitlines()
        if str(folder) in line and ("slurmctld" in line or "slurmd" in line)
    ]
    if folder.exists():
        found += [f"file {p}" for p in folder.iterdir()]
    return found


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # scripts/test.sh names the folder, and stops the cluster in its trap should pytest die before
    # this teardown
    given = os.environ.get("RELAYMPI_TEST_NODES_DIR")
    folder = Path(given) if given else tmp_path_factory.mktemp("nodes") / "cluster"
    proc = bash(
        "cluster/local_cluster.sh", "start", "--nodes", "2", "--link", "1gbit", "--dir", str(folder)
    )
    tag = None
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        cluster = Nodes(folder, parse_exports(proc.stdout))
        tag = cluster.tag
        yield cluster
    finally:
        stop = bash("cluster/local_cluster.sh", "stop", "--dir", str(folder))
        assert stop.returncode == 0, stop.stderr
        if tag is not None:
            assert leftovers(tag, folder) == []


@pytest.fixture(scope="module")
def reference(nodes: Nodes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The configuration on one node: plain mpirun -n 4 on this machine, without the cluster's
    variables,
    emulating the cluster's two nodes of two ranks (--placement auto places the trees by node on
    both)."""
    out = tmp_path_factory.mktemp("reference") / "one-node.h5"
    proc = subprocess.run(
        [
            "mpirun",
            "-n",
            "4",
            sys.executable,
            "-m",
            "relaympi.train",
            *TRAIN,
            "--ranks-per-node",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def datasets(path: Path) -> dict[str, np.ndarray]:
    """A run file's datasets but its time columns (wall-clock times differ between any two runs)."""
    with h5py.File(path, "r") as file:
        return {
            name: file[name][:]
            for name in file
            if isinstance(file[name], h5py.Dataset) and not name.startswith("time")
        }


def assert_same_run(path: Path, reference: Path) -> None:
    got, want = datasets(path), datasets(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def train_command(out: Path, *extra: str) -> str:
    return " ".join(
        shlex.quote(w)
        for w in [
            "mpirun",
            "-n",
            "4",
            sys.executable,
            "-m",
            "relaympi.train",
            *TRAIN,
            "--out",
            str(out),
            *extra,
        ]
    )


def sbatch(nodes: Nodes, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return nodes.run(
        "sbatch", "-N", "2", "--ntasks-per-node=2", "--no-requeue", *args, timeout=timeout
    )


def test_a_job_on_two_nodes_learns_bit_for_bit_what_one_node_does(
    nodes: Nodes, reference: Path, tmp_path: Path
) -> None:
    out, hosts = tmp_path / "two-nodes.h5", tmp_path / "hosts.txt"
    before = nodes.sent_bytes(2)
    wrap = f"mpirun -n 4 hostname > {shlex.quote(str(hosts))} && {train_command(out)}"
    proc = sbatch(nodes, "--wait", "-o", str(tmp_path / "job.out"), "--wrap", wrap)
    assert proc.returncode == 0, proc.stderr + (tmp_path / "job.out").read_text()[-3000:]
    # two ranks on each node
    assert sorted(hosts.read_text().split()) == ["node1", "node1", "node2", "node2"]
    after = nodes.sent_bytes(2)
    # every step's exchange between the nodes crossed node2's shaped link, both ways (MBs, not bytes
    # of SLURM)
    assert after[0] - before[0] > 4e6 and after[1] - before[1] > 4e6, (before, after)
    assert_same_run(out, reference)
    # MPI_COMM_TYPE_SHARED found the two nodes: the trees the one-node run emulated with
    # --ranks-per-node 2
    placed, emulated = read_run(out).topology, read_run(reference).topology
    assert placed is not None and emulated is not None
    assert placed.rank_node.tolist() == emulated.rank_node.tolist() == [0, 0, 1, 1]
    assert (
        placed.placement == emulated.placement == "nodes"
        and not placed.nodes_emulated
        and emulated.nodes_emulated
    )
    assert all(np.array_equal(a, b) for a, b in zip(placed.edges, emulated.edges, strict=True))


def job_state(nodes: Nodes, job: str) -> tuple[str, str]:
    text = nodes.run("scontrol", "show", "job", job).stdout
    return matched(r"JobState=(\S+)", text).group(1), matched(r"ExitCode=(\S+)", text).group(1)


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(
        {
            int(m.group(1))
            for p in folder.glob("rank*.step*.pt")
            if (m := re.search(r"step(\d+)", p.name))
        }
    )


def lose_node2(nodes: Nodes, job: str, ckpt: Path, log: Path, after_step: int, fault: str) -> int:
    """Once a checkpoint past ``after_step`` is there, kill node2 or cut its link; the job must end
    (non-zero) within 60 s."""
    deadline = time.monotonic() + 180
    while not [s for s in checkpoint_steps(ckpt) if s > after_step]:
        assert time.monotonic() < deadline, f"no checkpoint past step {after_step}: " + (
            log.read_text()[-3000:] if log.exists() else ""
        )
        assert job_state(nodes, job)[0] in ("PENDING", "CONFIGURING", "RUNNING"), log.read_text()[
            -3000:
        ]
        time.sleep(0.05)
    hit = time.monotonic()
    if fault == "kill":  # every process of node2: its slurmd, its job step, its ranks
        pids = subprocess.run(
            ["ip", "netns", "pids", nodes.ns(2)], capture_output=True, text=True
        ).stdout.split()
        assert pids
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        subprocess.run(["ip", "link", "set", nodes.veth(2), "down"], check=True)
    while (state := job_state(nodes, job))[0] in (
        "PENDING",
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
    ):
        assert time.monotonic() - hit < 60, (
            f"job {job} still {state[0]} 60 s after the fault ({fault})"
        )
        time.sleep(1)
    assert state[0] != "COMPLETED" and state[1] != "0:0", (fault, state)
    return max(checkpoint_steps(ckpt))


def test_losing_a_node_ends_the_job_and_a_rerun_resumes_to_the_same_numbers(
    nodes: Nodes, reference: Path, tmp_path: Path
) -> None:
    """Node2 killed (every process), then, in the rerun, node2's link down; the third run finishes
    as an uninterrupted one."""
    out, ckpt = tmp_path / "run.h5", tmp_path / "ckpt"
    command = train_command(out, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50")
    step = 0
    # a slow link, so that the run is still going when a checkpoint is there
    assert nodes.cluster("link", "100mbit").returncode == 0
    try:
        for fault in ("kill", "link-down"):
            log = tmp_path / f"{fault}.out"
            proc = sbatch(nodes, "--parsable", "-o", str(log), "--wrap", command)
            assert proc.returncode == 0, proc.stderr
            step = lose_node2(nodes, proc.stdout.strip(), ckpt, log, step, fault)
            subprocess.run(["ip", "link", "set", nodes.veth(2), "up"], check=True)
            # node2 back: start restarts what is missing and waits until every node is idle
            restart = nodes.cluster("start")
            assert restart.returncode == 0, restart.stderr
    finally:
        subprocess.run(["ip", "link", "set", nodes.veth(2), "up"], check=False)
        assert nodes.cluster("link", "1gbit").returncode == 0
    assert step < 300 and run_status(out) in ("running", "failed")
    proc = sbatch(nodes, "--wait", "-o", str(tmp_path / "rerun.out"), "--wrap", command)
    assert proc.returncode == 0, (tmp_path / "rerun.out").read_text()[-3000:]
    run = read_run(out)
    assert run.status == "completed"
    assert len(run.attrs["resumed_at_steps"]) == 2, (
        "the reruns did not resume from the checkpoints",
        run.attrs,
    )
    assert_same_run(out, reference)


def test_comm_benchmark_across_the_nodes_sends_its_bytes_over_the_link(
    nodes: Nodes, tmp_path: Path
) -> None:
    before = nodes.sent_bytes(2)
    hosts, launcher = (
        nodes.exports["RELAYMPI_CLUSTER_HOSTS"],
        nodes.exports["RELAYMPI_CLUSTER_LAUNCHER"],
    )
    proc = nodes.run(
        "mpiexec",
        "-launcher",
        "rsh",
        "-launcher-exec",
        launcher,
        "-f",
        hosts,
        "-n",
        "2",
        sys.executable,
        "-m",
        "benchmarks.comm",
        "--sizes",
        "1e6",
        "--warmup",
        "1",
        "--reps",
        "2",
        "--out",
        str(tmp_path / "comm.h5"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        re.search(r"^allreduce +1000000 ", proc.stdout, re.MULTILINE)
        and (tmp_path / "comm.h5").is_file()
    )
    after = nodes.sent_bytes(2)
    # 1e6 float32 = 4 MB per message; every operation sends it between the two nodes, each way,
    # several times
    assert after[0] - before[0] > 20e6 and after[1] - before[1] > 20e6, (before, after)


def test_links_change_rate_without_a_restart(nodes: Nodes) -> None:
    def rate() -> str:
        text = subprocess.run(
            ["tc", "qdisc", "show", "dev", nodes.veth(1)], capture_output=True, text=True
        ).stdout
        return matched(r"rate (\S+)", text).group(1) if "tbf" in text else "none"

    slurmd = (nodes.folder / "slurmd-node1.pid").read_text()
    try:
        assert nodes.cluster("link", "100mbit").returncode == 0 and rate() == "100Mbit"
        assert nodes.cluster("start", "--link", "none").returncode == 0 and rate() == "none"
        status = nodes.cluster("status")
        assert "links none" in status.stdout and "node2: " in status.stdout, status.stdout
    finally:
        assert nodes.cluster("link", "1gbit").returncode == 0 and rate() == "1Gbit"
    assert (nodes.folder / "slurmd-node1.pid").read_text() == slurmd  # the same daemon: no restart


@pytest.mark.parametrize(
    "args, message",
    [
        (["start", "--nodes", "0"], "--nodes must be a number in 1-64, got '0'"),
        (["start", "--nodes", "2", "--link", "fast"], "--link must be a tc rate such as 1gbit"),
        (
            ["start", "--nodes", "2", "--subnet", "8.8.8"],
            "--subnet must be the first three numbers of a private /24",
        ),
        (["link"], "link needs a RATE"),
    ],
)
def test_bad_node_options_exit_2_with_the_usage(
    args: list[str], message: str, tmp_path: Path
) -> None:
    proc = bash("cluster/local_cluster.sh", *args, "--dir", str(tmp_path / "c"))
    assert proc.returncode == 2 and message in proc.stderr and "usage:" in proc.stderr, proc.stderr
    assert not (tmp_path / "c").exists()


@contextlib.contextmanager
def readable_by_everyone(folder: Path) -> Iterator[Path]:
    """A copy of ``folder`` that any user may enter and read, in a new temporary folder removed
    after the block: a clone may sit in a folder only its owner can enter (mode 0700, as mktemp -d
    makes), where a script run as another user cannot be read."""

    def others_may_enter(path: Path) -> bool:
        return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))

    bases = (tempfile.gettempdir(), "/tmp", "/var/tmp")
    base = next((d for d in bases if others_may_enter(Path(d))), None)
    if base is None:
        pytest.skip("no temporary folder that other users may enter")
    with tempfile.TemporaryDirectory(prefix="relaympi-readable-", dir=base) as top:
        os.chmod(top, 0o755)
        copy = Path(top) / folder.name
        shutil.copytree(folder, copy)
        for path in (copy, *copy.rglob("*")):
            os.chmod(path, 0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        yield copy


def test_without_root_nodes_exit_2_with_one_line(tmp_path: Path) -> None:
    script = CLUSTER_TOOL
    with contextlib.ExitStack() as stack:
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            cmd = ["bash", str(script), "start", "--nodes", "2", "--dir", str(tmp_path / "c")]
            if os.geteuid() == 0:
                pytest.skip("needs setpriv to drop root")
        else:
            # the unprivileged user runs a copy of the script's folder that it can read
            copy = stack.enter_context(readable_by_everyone(script.parent)) / script.name
            cmd = [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "bash",
                str(copy),
                "start",
                "--nodes",
                "2",
                "--dir",
                str(tmp_path / "c"),
            ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd="/")
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1, (
        proc.stderr
    )
    assert "needs root" in proc.stderr


@pytest.mark.slow
def test_a_resume_at_an_evaluation_step_records_the_rows_an_uninterrupted_run_does(
    tmp_path: Path,
) -> None:
    """The row of the checkpoint's step is evaluated again after a resume: its train loss comes from
    the checkpoint.

    (A node lost after a periodic checkpoint resumes at an evaluation step; classification tasks
    have no train loss before a step, so it used to come back NaN.)
    """
    args = [
        sys.executable,
        "-m",
        "relaympi.train",
        "--backend",
        "local",
        "--workers",
        "2",
        "--task",
        "digits",
        "--steps",
        "60",
        "--eval-every",
        "20",
        "--log-every",
        "20",
    ]
    full = subprocess.run(
        [*args, "--out", str(tmp_path / "full.h5")],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = [*args, "--out", str(tmp_path / "r.h5"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    failed = subprocess.run(
        resumed,
        capture_output=True,
        text=True,
        env=clean_env(RELAYMPI_INJECT_FAILURE="1:40"),
        cwd=ROOT,
    )
    assert failed.returncode == 1 and list((tmp_path / "ckpt").glob("*step0000000040*")), (
        failed.stderr[-3000:]
    )
    again = subprocess.run(resumed, capture_output=True, text=True, env=clean_env(), cwd=ROOT)
    assert (
        again.returncode == 0
        and "resuming from the checkpoint of step 40" in again.stdout + again.stderr
    ), again.stderr[-3000:]
    assert_same_run(tmp_path / "r.h5", tmp_path / "full.h5")


def test_stop_after_a_crash_removes_everything_and_may_run_again(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path / "crashed"
    proc = bash("cluster/local_cluster.sh", "start", "--nodes", "1", "--dir", str(folder))
    assert proc.returncode == 0, proc.stderr
    tag = Nodes(folder, parse_exports(proc.stdout)).tag
    try:
        # a crash: every daemon killed without a word, their pid files gone
        victims = subprocess.run(
            ["ip", "netns", "pids", f"rmpi{tag}-node1"], capture_output=True, text=True
        ).stdout.split()
        victims.append((folder / "slurmctld.pid").read_text().strip())
        for pid in victims:
            os.kill(int(pid), signal.SIGKILL)
        for pid_file in folder.glob("*.pid"):
            pid_file.unlink()
    finally:
        for _ in range(2):  # idempotent
            stop = bash("cluster/local_cluster.sh", "stop", "--dir", str(folder))
            assert stop.returncode == 0, stop.stderr
            assert leftovers(tag, folder) == []


@requires_ulfm
def test_open_mpi_places_two_ranks_per_node_and_survives_a_lost_rank(
    nodes: Nodes, tmp_path: Path
) -> None:
    program, out = tmp_path / "survive.py", tmp_path / "survive.out"
    program.write_text(SURVIVE)
    launch = [ROOT / "scripts" / "mpirun-ulfm", "--iface", nodes.iface, "--map-by", "ppr:2:node"]
    argv = [*launch, "-n", 4, sys.executable, program, 3]  # rank 3 (on the second node) dies
    wrap = f"timeout 120 {shlex.join(map(str, argv))} > {shlex.quote(str(out))}"
    proc = sbatch(nodes, "--wait", "-o", str(tmp_path / "job.out"), "--wrap", wrap, timeout=200)
    found = sorted(records(out.read_text() if out.exists() else ""), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == [0, 1, 2], (
        proc.stderr + (tmp_path / "job.out").read_text()[-3000:]
    )
    hosts = found[0]["hosts"]
    # ranks 0-1 on one node, 2-3 on the other
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    for record in found:
        assert record["hosts"] == hosts and record["before"] == 1111.0
        assert record["size"] == 3 and record["sum"] == 111.0 and record["ranks"] == [0, 1, 2]
        assert record["missing"] is None

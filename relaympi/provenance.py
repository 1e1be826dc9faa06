"""Where a result came from: code version, libraries, hosts, scheduler job."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy

import relaympi
from relaympi.costs import launch_shape
from relaympi.threads import allowed_cpus

# set by the emulated-cluster tool (cluster/local_cluster.sh): the shaped link rate its nodes
# run over
EMULATED_LINK_ENV = "RELAYMPI_EMULATED_LINK"
_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_NNODES",
    "SLURM_NTASKS",
)


def git_commit() -> str:
    """The commit of the relaympi checkout (with '-dirty' for local changes), or 'unknown'."""
    root = Path(relaympi.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name"; else platform.processor())."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return " ".join(line.partition(":")[2].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def node_local_ranks(hosts: list[str]) -> list[int]:
    """Each rank's rank among the ranks of its node, in rank order (MPI_COMM_TYPE_SHARED's order,
    the local rank MPICH, Open MPI and SLURM give it; --device cuda picks its GPU by it)."""
    seen: dict[str, int] = {}
    local = []
    for host in hosts:
        local.append(seen.get(host, 0))
        seen[host] = local[-1] + 1
    return local


def collect(
    transport: dict[str, Any], hosts: list[str] | None = None, command: str | None = None
) -> dict[str, Any]:
    """Provenance of a run; `command` is the command that runs it again (default: this process's
    argv).

    ``hosts`` is every rank's host name (rank 0 gathers them), one per process: with it, the
    launch shape is recorded as ``nodes`` and ``ranks_per_node``.
    """
    info: dict[str, Any] = {
        "relaympi_version": relaympi.__version__,
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "platform": platform.platform(),
        "hosts": sorted(set(hosts or [socket.gethostname()])),
        "command": command if command is not None else shlex.join(sys.argv),
        "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus_allowed": len(allowed_cpus()),
        "cpu_model": cpu_model(),
        **{f"transport_{k}": v for k, v in transport.items()},
    }
    try:  # torch is optional here: benchmarks record provenance without it
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda or "none"
        # what relaympi.threads' rule or --threads chose
        info["torch_threads"] = torch.get_num_threads()
        # only a run on a GPU has initialized CUDA: never start it here
        if torch.cuda.is_initialized():
            info["gpu_model"] = torch.cuda.get_device_name(torch.cuda.current_device())
    except ImportError:
        info["torch"] = "not installed"
    if hosts:
        info.update(launch_shape(hosts))
        info["rank_hosts"] = list(hosts)  # rank r ran on rank_hosts[r]
        info["rank_local_ranks"] = node_local_ranks(hosts)
    if os.environ.get(EMULATED_LINK_ENV):
        info["emulated_link"] = os.environ[EMULATED_LINK_ENV]
    for var in _SLURM_VARS:
        if var in os.environ:
            info[var.lower()] = os.environ[var]
    return info

"""Runs know where they are: each rank's node and node-local rank in the run file, the summary's
"N workers on M nodes", the GPU a rank picks, and a checkpoint folder every node must see."""

from __future__ import annotations

import pytest

from relaympi import provenance, train
from relaympi.config import ConfigError, parse_args
from relaympi.results import read_run
from relaympi.training import loop
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.run_file import placement_text


def test_node_local_ranks_count_the_lower_ranks_of_the_same_node():
    # by hand: node1 holds ranks 0, 1, 4; node2 holds 2, 3; node3 holds 5
    hosts = ["node1", "node1", "node2", "node2", "node1", "node3"]
    assert provenance.node_local_ranks(hosts) == [0, 1, 0, 1, 2, 0]


def test_provenance_records_every_ranks_node_and_local_rank():
    info = provenance.collect({"backend": "mpi"}, ["n1", "n2", "n1", "n2"], command="x")
    assert info["rank_hosts"] == ["n1", "n2", "n1", "n2"]
    assert info["rank_local_ranks"] == [0, 0, 1, 1]
    assert info["nodes"] == 2 and info["ranks_per_node"] == 2


@pytest.mark.parametrize(
    "world_size,nodes,text",
    [
        (16, 4, " | 16 workers on 4 nodes"),
        (1, 1, " | 1 worker on 1 node"),
        (None, 2, ""),
        (8, None, ""),
    ],
)
def test_summary_placement_text(world_size, nodes, text):
    assert placement_text(world_size, {} if nodes is None else {"nodes": nodes}) == text


def test_a_local_run_records_its_ranks_and_says_where_it_ran(tmp_path, capsys):
    out = tmp_path / "r.h5"
    args = [
        "--task",
        "quadratics",
        "--backend",
        "local",
        "--workers",
        "3",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        "2",
        "--out",
        str(out),
    ]
    assert train.main(args) == 0
    run = read_run(out)
    host = run.provenance["rank_hosts"][0]
    assert run.provenance["rank_hosts"] == [host] * 3 and run.provenance["rank_local_ranks"] == [
        0,
        1,
        2,
    ]
    assert "| 3 workers on 1 node" in capsys.readouterr().out


@pytest.mark.parametrize(
    "env,count,device",
    [
        ({"MPI_LOCALRANKID": "1"}, 2, "cuda:1"),  # MPICH, second rank of its node
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 2, "cuda:1"),  # Open MPI: local rank modulo the GPUs
        # srun: node-local, not the world rank
        ({"SLURM_LOCALID": "0", "SLURM_PROCID": "5"}, 4, "cuda:0"),
    ],
)
def test_device_cuda_picks_the_gpu_of_the_node_local_rank(monkeypatch, env, count, device):
    for variable in (
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "SLURM_PROCID",
        "PMI_RANK",
        "OMPI_COMM_WORLD_RANK",
    ):
        monkeypatch.delenv(variable, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(loop.torch.cuda, "device_count", lambda: count)
    cfg = parse_args(["--device", "cuda", "--backend", "local", "--workers", "2"])
    assert loop.device_for(cfg, rank=5) == device


def _checkpoints(directory):
    cfg = parse_args(["--backend", "local", "--workers", "2", "--checkpoint-dir", str(directory)])
    return Checkpoints(cfg, directory / "r.h5", 0, 2)


def test_a_checkpoint_folder_every_node_sees_is_accepted(tmp_path):
    shared = _checkpoints(tmp_path / "ck")
    for host in ("node1", "node2"):
        shared.mark_host(host)
    shared.check_shared(["node1", "node1", "node2", "node2"])
    assert not list((tmp_path / "ck").glob(".host-*"))  # the marks are removed


def test_a_node_local_checkpoint_folder_is_refused(tmp_path):
    # node2's ranks wrote their mark on node2's own disk: rank 0 (node1) cannot see it
    rank0 = _checkpoints(tmp_path / "node1-disk")
    _checkpoints(tmp_path / "node2-disk").mark_host("node2")
    rank0.mark_host("node1")
    with pytest.raises(
        ConfigError,
        match=r"not shared between the run's nodes: rank 0 on node1 cannot see what the ranks "
        r"on node2 write",
    ):
        rank0.check_shared(["node1", "node2"])

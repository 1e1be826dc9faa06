"""benchmarks.membw: the byte model against hand-derived counts, the triad under mpirun, the
table."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import membw
from relaympi.topology import build

REPO = Path(__file__).resolve().parents[1]
# the venv's MPICH (pip install mpich) sits beside its python, on PATH or not
MPIRUN = shutil.which(
    "mpirun", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
)


def _elements(t: membw.Traffic) -> tuple[list[float], list[float]]:
    """Per rank (elements read, elements written): the hand derivations count float32 elements."""
    return list(t.reads / 4), list(t.writes / 4)


# Hand derivations (d = numel, m = message = block + 1 counter; 2 copies per MPI transfer: each
# message costs its sender m read + m written and its receiver m read + m written).
def test_relaysum_chain_of_3():
    # d = 10, m = 11. Ranks 0, 2: leaves (1 message out, 1 in, no assembly): 2m / 2m. Rank 1 (degree
    # 2): 2 out, 2 in: 4m / 4m; assembly reads parcel + 2 rows, writes 2 rows: 3m / 2m.
    reads, writes = _elements(membw.traffic("relaysum", build("chain", 3), 10))
    assert reads == [22, 77, 22]
    assert writes == [22, 66, 22]
    reads, writes = _elements(membw.traffic("raw", build("chain", 3), 10))
    assert reads == writes == [22, 44, 22]


def test_single_copy_transfers_cost_the_receiver_only():
    # chain of 3, d = 10, m = 11: rank 1 receives 2 messages, the leaves 1; each costs m read +
    # m written
    reads, writes = _elements(membw.traffic("raw", build("chain", 3), 10, copies=1))
    assert reads == writes == [11, 22, 11]


def test_double_binary_trees_of_4():
    # d = 10: two blocks of 5, m = 6. Tree A edges 0-1, 0-2, 1-3; tree B (mirror) 3-2, 3-1, 2-0.
    # Every rank is degree 2 in one tree, a leaf in the other: 3 neighbours over both layers,
    # messages 3 x (2m / 2m) = 36 / 36; assembly of the degree-2 layer 3m / 2m = 18 / 12.
    topo = build("double-binary-trees", 4)
    assert _elements(membw.traffic("raw", topo, 10)) == ([36] * 4, [36] * 4)
    assert _elements(membw.traffic("relaysum", topo, 10)) == ([54] * 4, [48] * 4)
    # in place: the degree-2 layer's two received chunks land from the bounce buffer: + 2m / 2m
    assert _elements(membw.traffic("relaysum-in-place", topo, 10)) == ([66] * 4, [60] * 4)
    # the RelaySGD step: + SGD (read g, x; write u, x: 20 / 20) + add_received per layer, read x
    # and the k payloads of s = 5, write x: degree 2: 15 / 5, leaf: 10 / 5
    assert _elements(membw.traffic("relaysgd-step", topo, 10)) == ([99] * 4, [78] * 4)


def test_degree_3_node_star_of_4():
    # d = 10, m = 11. Hub 0 (degree 3): messages 3 x (2m / 2m) = 66 / 66; assembly sums 3 rows into
    # total, adds the parcel, rows = total - rows: reads 3 rows + parcel, writes total + 3 rows = 44
    # / 44.
    topo = build("star", 4)
    reads, writes = _elements(membw.traffic("relaysum", topo, 10))
    assert reads == [110, 22, 22, 22] and writes == [110, 22, 22, 22]
    # step: the sum is kept by add_received, so assembly reads total + parcel + 3 rows (55), writes
    # 44; add_received reads 3 payloads of 10 + x (40), writes total + x (20); SGD 20 / 20. Leaves:
    # 22 / 22 + SGD 20 / 20 + add_received (x + 1 payload: 20 / 10).
    reads, writes = _elements(membw.traffic("relaysgd-step", topo, 10))
    assert reads == [66 + 55 + 20 + 40, 62, 62, 62]
    assert writes == [66 + 44 + 20 + 20, 52, 52, 52]
    reads, writes = _elements(membw.traffic("relaysum", topo, 10, copies=1))
    assert reads == writes == [33 + 44, 11, 11, 11]


def test_allreduce_reduce_scatter_allgather():
    # n = 4, d = 8: each rank sends and receives 2 (n-1)/n d = 12 elements (12 / 12 each way with
    # two copies: 24 / 24) and reduces (n-1)/n d = 6 elements (reads 12, writes 6)
    reads, writes = _elements(membw.traffic("allreduce", build("chain", 4), 8))
    assert reads == pytest.approx([36] * 4) and writes == pytest.approx([30] * 4)


@pytest.mark.parametrize(
    "topo_name, n, numel",
    [("double-binary-trees", 5, 11), ("chain", 4, 7), ("double-binary-trees", 16, 1001)],
)
def test_raw_model_counts_the_benchmarks_messages(topo_name, n, numel):
    """The model's messages are benchmarks.comm's raw exchange's: sent bytes per rank, x 4 with two
    copies."""
    import torch

    from benchmarks.comm import _raw_exchange, _relay_messages
    from relaympi.algorithms.relaysum import RelaySum
    from relaympi.comm import run_local
    from relaympi.flat import padded_zeros

    def body(comm):
        relay = RelaySum(comm, build(topo_name, n), numel, padded_zeros(numel))
        return _raw_exchange(comm, _relay_messages(relay), torch.device("cpu")).bytes_per_call

    sent = np.array(run_local(n, body), dtype=float)
    model = membw.traffic("raw", build(topo_name, n), numel)
    # each rank receives what it sends, by symmetry
    np.testing.assert_allclose(model.per_rank, 4 * sent)
    assert model.total == pytest.approx(4 * sent.sum())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="copies must be one of"):
        membw.traffic("raw", build("chain", 3), 10, copies=3)
    with pytest.raises(ValueError, match="unknown case 'gossip'"):
        membw.traffic("gossip", build("chain", 3), 10)
    with pytest.raises(ValueError, match="tree topology"):
        membw.traffic("relaysum", build("ring", 4), 10)
    assert membw.comm_case_traffic("gossip ring", 4, 10) is None


def test_limit_takes_the_binding_bound():
    t = membw.traffic("raw", build("chain", 3), 1000)  # ranks 8000 / 16000 / 8000 bytes x 2
    triad = {"aggregate_gbs": 1e-3, "single_rank_gbs": 1e-3}  # 1e6 B/s
    assert membw.memory_limit(t, triad) == (pytest.approx(t.total / 1e6), "aggregate")
    triad = {"aggregate_gbs": 1.0, "single_rank_gbs": 1e-3}
    assert membw.memory_limit(t, triad) == (
        pytest.approx(float(t.per_rank.max()) / 1e6),
        "one rank",
    )


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_model_table_from_a_comm_result(tmp_path):
    """benchmarks.comm's HDF5 (in-process ranks) -> the table's JSON: limit = model bytes / triad,
    ratio = measured / limit."""
    h5 = tmp_path / "comm.h5"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.comm",
            "--backend",
            "local",
            "--workers",
            "2",
            "--sizes",
            "1000",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--out",
            str(h5),
        ],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
        timeout=120,
    )
    triad = {"ranks": 2, "aggregate_gbs": 10.0, "single_rank_gbs": 8.0, "array_mib": 1, "reps": 1}
    (tmp_path / "triad.json").write_text(json.dumps(triad))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.membw",
            "model",
            "--comm",
            str(h5),
            "--triad",
            str(tmp_path / "triad.json"),
            "--json",
        ],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    result = json.loads(out.stdout)
    assert result["world_size"] == 2
    cases = {c["op"]: c for c in result["cases"]}
    # gossip/SGP are not modelled (and gossip needs n >= 3)
    assert set(cases) == set(membw.COMM_CASES)
    raw = cases["raw isend/irecv chain"]
    m = 1001  # the chain's one message, both ways, two copies: 4 x 2 messages x 4 bytes
    assert raw["model_gb"] == pytest.approx(4 * 2 * m * 4 / 1e9)
    assert raw["limit_ms"] == pytest.approx(
        max(raw["model_gb"] / 10.0, raw["max_rank_gb"] / 8.0) * 1e3
    )
    assert raw["ratio"] == pytest.approx(raw["measured_ms"] / raw["limit_ms"])
    text = subprocess.run(
        [sys.executable, "-m", "benchmarks.membw", "model", "--comm", str(h5), "--ranks", "3"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        text.returncode == 2 and "--ranks 3 but the --comm results are for 2 ranks" in text.stderr
    )


@pytest.mark.slow
@pytest.mark.mpirun
@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun")
def test_triad_under_mpirun_2(tmp_path):
    assert MPIRUN is not None
    out = tmp_path / "triad.json"
    run = subprocess.run(
        [
            MPIRUN,
            "-n",
            "2",
            sys.executable,
            "-m",
            "benchmarks.membw",
            "triad",
            "--mib",
            "2",
            "--reps",
            "3",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "2 ranks x 3 arrays x 524288 float32" in run.stdout  # the sizes used are printed
    result = json.loads(out.read_text())
    assert (
        result["ranks"] == 2
        and result["elements_per_array"] == 2 * 2**20 // 4
        and result["reps"] == 3
    )
    assert result["bytes_per_element"] == 12 and result["write_allocate_counted"] is False
    assert result["torch_threads"] == 1
    assert len(result["aggregate_seconds"]) == len(result["single_rank_seconds"]) == 3
    for key in ("aggregate_gbs", "single_rank_gbs"):
        assert math.isfinite(result[key]) and 0.1 < result[key] < 1e5
    # best of the lockstep repetitions: 2 ranks x 12 bytes x elements over the fastest one
    assert result["aggregate_gbs"] == pytest.approx(
        2 * 12 * result["elements_per_array"] / min(result["aggregate_seconds"]) / 1e9
    )

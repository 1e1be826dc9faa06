"""benchmarks.comm: the figures it writes, and VGG-11's size derived from the architecture."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from benchmarks import comm as bench


def test_vgg11_size_is_derived_from_the_architecture():
    """Eight 3x3 convolutions (weights + biases) on widths 3-64-128-256-256-512-512-512-512, then
    Linear(512, 10)."""
    widths = [3, 64, 128, 256, 256, 512, 512, 512, 512]
    convs = sum(cin * cout * 9 + cout for cin, cout in zip(widths[:-1], widths[1:], strict=True))
    assert bench.vgg11_params() == convs + 512 * 10 + 10 == 9_225_610


def test_benchmark_writes_every_operation_with_its_ratios(tmp_path, capsys):
    out = tmp_path / "comm.h5"
    assert (
        bench.main(
            [
                "--backend",
                "local",
                "--workers",
                "4",
                "--sizes",
                "1000",
                "--reps",
                "1",
                "--warmup",
                "0",
                "--chunk",
                "300",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "chunk 300 elements" in printed
    with h5py.File(out) as f:
        ops = [op.decode() if isinstance(op, bytes) else op for op in f["op"][()]]
        assert f.attrs["chunk"] == 300 and f.attrs["world_size"] == 4
        ratios, vs_allreduce, sent = f["vs_raw"][()], f["vs_allreduce"][()], f["bytes_per_rank"][()]
    expected = {
        "raw isend/irecv chain",
        "relaysum chain",
        "relaysum in-place chain",
        "raw isend/irecv double-binary-trees",
        "relaysum double-binary-trees",
        "relaysum in-place double-binary-trees",
        "relaysgd step double-binary-trees",
        "raw isend/irecv ring",
        "gossip ring",
        "sgp round",
        "allreduce",
        "iallreduce fixed tree",
        "iallreduce fixed tree 8 pieces",
    }
    assert set(ops) == expected
    row = {op: i for i, op in enumerate(ops)}
    # a ratio to raw exactly for RelaySum and the RelaySGD step, to allreduce for all others
    for op in ops:
        assert np.isfinite(ratios[row[op]]) == op.startswith(("relaysum", "relaysgd", "gossip"))
        assert np.isfinite(vs_allreduce[row[op]]) == (op != "allreduce")
    # rank 0's bytes per call: RelaySum sends exactly the raw exchange's messages. On a 4-chain
    # rank 0 is a leaf (one message of 1000 + 1 float32s); on double binary trees of 4 it has two
    # children in tree 0 and is a leaf in tree 1, each message carrying a 500-coordinate half and
    # a counter.
    for topo, messages in (("chain", [1001]), ("double-binary-trees", [501, 501, 501])):
        assert (
            sent[row[f"raw isend/irecv {topo}"]]
            == sent[row[f"relaysum {topo}"]]
            == 4 * sum(messages)
        )
        assert sent[row[f"relaysum in-place {topo}"]] == 4 * sum(messages)
    assert (
        sent[row["allreduce"]]
        == sent[row["iallreduce fixed tree"]]
        == sent[row["iallreduce fixed tree 8 pieces"]]
        == 4 * 1000
    )


def test_node_aware_rows_and_each_ranks_inter_node_bytes(tmp_path):
    """4 ranks on 2 emulated nodes: every placed operation gets a node-aware row; the inter-node
    column is the busiest rank's bytes to the other node, derived here from the topologies'
    edges."""
    from relaympi.topology import build

    out = tmp_path / "comm.h5"
    args = [
        "--backend",
        "local",
        "--workers",
        "4",
        "--ranks-per-node",
        "2",
        "--sizes",
        "1000",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0
    with h5py.File(out) as f:
        ops = [op.decode() if isinstance(op, bytes) else op for op in f["op"][()]]
        inter, ratios = f["inter_node_bytes"][()], f["vs_raw"][()]
        assert list(f.attrs["nodes"]) == [0, 0, 1, 1]
    row = {op: i for i, op in enumerate(ops)}
    nodes = (0, 0, 1, 1)

    def busiest(name: str, placed: bool) -> float:
        topology = build(name, 4, placement="nodes", nodes=nodes) if placed else build(name, 4)
        blocks = topology.coordinate_blocks(1000)
        counter = 1 if topology.is_tree else 0  # RelaySum's messages carry their counter
        return max(
            sum(
                4 * (b.stop - b.start + counter)
                for k, b in enumerate(blocks)
                for peer in topology.neighbors(rank, k)
                if nodes[peer] != nodes[rank]
            )
            for rank in range(4)
        )

    for suffix, placed in (("", False), (" node-aware", True)):
        for topo in ("chain", "double-binary-trees"):
            want = busiest(topo, placed)
            for op in (f"raw isend/irecv {topo}", f"relaysum {topo}", f"relaysum in-place {topo}"):
                assert inter[row[op + suffix]] == want, op + suffix
        assert inter[row["relaysgd step double-binary-trees" + suffix]] == busiest(
            "double-binary-trees", placed
        )
        assert (
            inter[row["gossip ring" + suffix]]
            == inter[row["raw isend/irecv ring" + suffix]]
            == busiest("ring", placed)
        )
        assert np.isfinite(ratios[row["gossip ring" + suffix]])
    # rank order crosses the nodes on 2 edges per tree (rank 0 sends both halves to rank 2);
    # node-aware on 1
    assert inter[row["relaysum double-binary-trees"]] == 4 * (501 + 501)
    assert (
        inter[row["relaysum double-binary-trees node-aware"]]
        < inter[row["relaysum double-binary-trees"]]
    )
    assert np.isnan(inter[row["allreduce"]])


@pytest.mark.parametrize(
    "nodes, numel, order, want",
    [
        # node-aware: the second half-split crosses, half of the buffer's half each way
        ((0, 0, 1, 1), 1000, (1, 2), 4 * 500),
        # the first split across nodes: half the buffer there, the same back
        ((0, 0, 1, 1), 1000, (2, 1), 4 * 1000),
        ((0, 1), 7, (1,), 4 * 7),  # one stage: 4 elements given, 3 kept and sent back
        # 6 ranks, p = 4: ranks 4, 5 fold into 0, 1 across nodes (1000 each way); rank 1 also
        # crosses at d = 2 (1000)
        ((0, 0, 0, 1, 1, 1), 1000, (2, 1), 4 * 2000),
    ],
)
def test_the_tree_all_reduces_inter_node_bytes_by_hand(nodes, numel, order, want):
    assert bench.tree_inter_node_bytes(list(nodes), [numel], order) == want


def test_pieces_inter_node_bytes_are_the_busiest_ranks_sum():
    # (0, 0, 0, 1, 1, 1), order (2, 1), pieces of 7 and 4. Rank 1: the fold with rank 5 (7, then 4)
    # and d = 2 with rank 3 (its whole segment: 7, then 4) = 22. Rank 3: d = 2 (7, 4) and d = 1 with
    # rank 2 (its upper half: 4, then 2) = 17. Ranks 0, 4, 5: the fold, 11. Rank 2: 6.
    assert bench.tree_inter_node_bytes([0, 0, 0, 1, 1, 1], [7, 4], (2, 1)) == 4 * 22
    # rank 1 is the busiest for both
    assert bench.tree_inter_node_bytes([0, 0, 0, 1, 1, 1], [7, 4], (2, 1)) == sum(
        bench.tree_inter_node_bytes([0, 0, 0, 1, 1, 1], [size], (2, 1)) for size in (7, 4)
    )


def test_sgp_is_timed_in_whole_periods_of_its_schedule():
    """Each timed call of "sgp round" runs every round of the exponential schedule once (offsets
    1, 2, 4 on 8 ranks), whichever call it is: the figure cannot depend on which rounds --warmup
    leaves to be timed (with ranks round-robin over nodes, the offsets alternate between peers on
    other nodes and on this one)."""
    import torch

    from relaympi.comm import run_local

    def body(comm):
        sgp = bench._cases(comm, 64, torch.device("cpu"), 1024)["sgp round"]
        rounds, exchange = [], comm.exchange

        def spy(sends, recvs, *args, round, **kwargs):
            rounds.append((round, *sends))
            return exchange(sends, recvs, *args, round=round, **kwargs)

        comm.exchange = spy
        for call in (0, 1, 4):  # any call, odd or even
            sgp(call)
        return sgp.rounds_per_call, rounds

    for rank, (per_call, rounds) in enumerate(run_local(8, body)):
        assert per_call == 3
        assert [r for r, _ in rounds] == [0, 1, 2, 3, 4, 5, 12, 13, 14]
        # rank i sends to i - offset
        assert [(rank - peer) % 8 for _, peer in rounds] == [1, 2, 4] * 3


def test_sgp_row_is_one_round_the_mean_of_a_period(tmp_path, monkeypatch):
    from relaympi.flat import padded_zeros

    def three_ms_a_round(comm, fn, warmup, reps, device):
        for call in range(warmup + reps):
            fn(call)
        return 0.003 * getattr(fn, "rounds_per_call", 1)

    monkeypatch.setattr(bench, "_time", three_ms_a_round)
    out = tmp_path / "comm.h5"
    args = ["--backend", "local", "--workers", "8", "--sizes", "1000", "--reps", "1"]
    args += ["--warmup", "1"]
    assert bench.main([*args, "--out", str(out)]) == 0
    with h5py.File(out) as f:
        ops = [op.decode() if isinstance(op, bytes) else op for op in f["op"][()]]
        row = ops.index("sgp round")
        assert f["median_s"][row] == pytest.approx(0.003)
        assert f["bytes_per_rank"][row] == 4 * padded_zeros(1000).numel()  # one model per round

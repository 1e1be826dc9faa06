"""benchmarks.peers: the side-by-side harness feeds relaympi and its peers the same task."""

from __future__ import annotations

import pytest

from benchmarks import peers
from tests.conftest import requires_mpirun


@pytest.mark.slow
@requires_mpirun
def test_allreduce_and_ddp_reach_the_same_accuracy(tmp_path):
    """The same model (seed), shards, batch stream, lr and averaged gradients: with two workers
    the mean of two gradients is exact either way, so both systems train the same model."""
    _, ours = peers.run_relaympi("allreduce", None, 2, 12, tmp_path)
    _, ddp = peers.run_peer("ddp", "allreduce", None, 2, 12, tmp_path)
    assert ours["accuracy"] == ddp["accuracy"]
    assert 0.3 < ours["accuracy"] < 1  # it trained: 10 classes start near 0.1
    assert ours["ms_per_step"] > 0 and ddp["ms_per_step"] > 0
    assert ours["bytes_per_step"] > 0


def test_a_missing_peer_is_named_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(peers.PEER_NEEDS, "decent-dp", ("no_such_module_here", "decent-dp"))
    assert peers.main(["--pair", "dpsgd:decent-dp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "benchmarks.peers: peer 'decent-dp' needs decent-dp: pip install -e .[peers] "
        "(or pip install decent-dp)"
    )


def test_bad_flags_exit_with_status_2(capsys):
    with pytest.raises(SystemExit) as info:
        peers.main(["--workers", "1"])
    assert info.value.code == 2
    assert "--workers >= 2" in capsys.readouterr().err


def test_the_report_gives_medians_extremes_and_ratios_per_rep():
    def rep(ours: float, theirs: float) -> tuple[peers.Measure, peers.Measure]:
        return (
            peers.Measure("relaympi", ours, ours / 1e3, 100.0, False, 0.9),
            peers.Measure("ddp", theirs, theirs / 1e3, 100.0, True, 0.9),
        )

    text = peers.report("allreduce:ddp", [rep(2.0, 4.0), rep(3.0, 3.0), rep(8.0, 4.0)])
    assert "relaympi   3 [2-8]" in text
    assert "ddp        4 [3-4]" in text
    # ratios 0.5, 1.0, 2.0 rep by rep
    assert "ms/step 1.00 [0.50-2.00]x, CPU 1.00 [0.50-2.00]x" in text
    assert "100       est" in text


def test_a_variant_is_relaympi_with_its_environment_and_gets_ratios_to_both():
    assert peers.parse_variant("spin:RELAYMPI_WAIT=spin,RELAYMPI_AGREEMENT_LAG=0") == (
        "spin",
        {"RELAYMPI_WAIT": "spin", "RELAYMPI_AGREEMENT_LAG": "0"},
    )
    for bad in ("spin", "spin:", ":A=1", "spin:A"):
        with pytest.raises(ValueError, match="expected NAME:VAR=VALUE"):
            peers.parse_variant(bad)
    rep = (
        peers.Measure("relaympi", 2.0, 2e-3, 100.0, False, 0.9),
        peers.Measure("spin", 3.0, 6e-3, 100.0, False, 0.9),
        peers.Measure("ddp", 4.0, 4e-3, 100.0, True, 0.9),
    )
    text = peers.report("allreduce:ddp", [rep])
    assert "ratio relaympi/peer: ms/step 0.50 [0.50-0.50]x, CPU 0.50 [0.50-0.50]x" in text
    assert "ratio spin/peer: ms/step 0.75 [0.75-0.75]x, CPU 1.50 [1.50-1.50]x" in text
    assert "ratio spin/relaympi: ms/step 1.50 [1.50-1.50]x, CPU 3.00 [3.00-3.00]x" in text


def _decent_dp_rounds(name: str, workers: int, local: int) -> list[int]:
    """Decent-DP's own edges for rank 0 (decent_dp.topo, built without a process group): the size
    of its group in each round."""
    topo = pytest.importorskip("decent_dp.topo")
    topology = object.__new__(topo.TopologyReg.registry[name])
    topology._rank, topology._world_size = 0, workers
    topology._local_world_size, topology._n_nodes = local, workers // local
    rounds = topology._get_topo_edges()
    return [len(next(e.ranks for e in edges if 0 in e.ranks)) for edges in rounds]


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_decent_dp_topologies_match_decent_dps_own_edges(workers):
    for name in peers.DECENT_DP_TOPOLOGIES:
        local = peers.decent_dp_local_world_size(name, workers)
        if local is None:
            continue
        assert peers.decent_dp_group_sizes(name, workers) == _decent_dp_rounds(name, workers, local)
    # two emulated nodes for the within-node / across-nodes alternation, from 4 ranks on
    assert peers.decent_dp_local_world_size("alternating-exp-ring", workers) == (
        workers // 2 if workers >= 4 else None
    )


def test_decent_dp_topologies_that_cannot_pair_the_ranks_are_left_out():
    assert peers.decent_dp_local_world_size("ring", 3) is None
    assert peers.decent_dp_local_world_size("one-peer-exp", 6) is None
    assert peers.decent_dp_local_world_size("complete", 3) == 3
    assert peers.decent_dp_local_world_size("alternating-exp-ring", 6) == 3
    assert peers.peer_topologies("relay:decent-dp", 2, None) == ("ring", "complete", "one-peer-exp")
    assert peers.peer_topologies("relay:decent-dp", 4, None) == peers.DECENT_DP_TOPOLOGIES
    assert peers.peer_topologies("dpsgd:decent-dp", 4, None) == ("ring",)
    assert peers.peer_topologies("allreduce:ddp", 4, None) == ()
    assert peers.peer_topologies("dpsgd:decent-dp", 4, ["complete", "complete"]) == ("complete",)
    with pytest.raises(ValueError, match="'alternating-exp-ring' does not apply to 2 workers"):
        peers.peer_topologies("relay:decent-dp", 2, ["alternating-exp-ring"])


def test_decent_dp_bytes_are_gloos_all_reduce_over_each_rounds_group():
    assert peers.decent_dp_models_per_step("ring", 4) == 1.0
    assert peers.decent_dp_models_per_step("complete", 4) == 2 * 3 / 4
    # rounds within a node of 2 (one model), then across both nodes, 4 ranks (1.5 models)
    assert peers.decent_dp_models_per_step("alternating-exp-ring", 4) == (1.0 + 1.5) / 2


def test_the_pairs_own_peer_keeps_its_name_and_other_topologies_are_named():
    assert peers.peer_systems("dpsgd:decent-dp", ("ring",)) == {"decent-dp": "ring"}
    assert peers.peer_systems("allreduce:ddp", ()) == {"ddp": None}
    assert peers.peer_systems("relay:decent-dp", ("ring", "complete")) == {
        "decent-dp:ring": "ring",
        "decent-dp:complete": "complete",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--pair",
                "relay:decent-dp",
                "--workers",
                "2",
                "--peer-topology",
                "alternating-exp-ring",
            ],
            "--peer-topology 'alternating-exp-ring' does not apply to 2 workers",
        ),
        (
            ["--pair", "allreduce:ddp", "--peer-topology", "ring"],
            "--peer-topology applies to the training pairs with Decent-DP",
        ),
        (["--peer-topology", "star"], "invalid choice: 'star'"),
        (["--comm-floats", "0"], "--comm-floats must be >= 1, got 0"),
        (["--comm-floats", "10", "--steps", "1"], "--steps >= 2 are allowed"),
        (
            ["--comm-floats", "10", "--pair", "allreduce:ddp"],
            "--pair 'allreduce:ddp' with --comm-floats; allowed: allreduce:gloo, gossip:decent-dp",
        ),
        (["--pair", "gossip:decent-dp"], "--pair 'gossip:decent-dp' without --comm-floats"),
        (["--comm-floats", "10", "--peer-topology", "ring"], "--peer-topology applies"),
    ],
)
def test_bad_new_flags_exit_with_status_2_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        peers.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_several_peers_get_a_ratio_each_and_the_fastest_is_named():
    rep = (
        peers.Measure("relaympi", 3.0, 3e-3, 100.0, False, 0.9),
        peers.Measure("decent-dp:ring", 6.0, 2e-3, 100.0, True, 0.9),
        peers.Measure("decent-dp:complete", 2.0, 6e-3, 150.0, True, 0.9),
    )
    text = peers.report("relay:decent-dp", [rep])
    assert "ratio relaympi/decent-dp:ring: ms/step 0.50 [0.50-0.50]x, CPU 1.50" in text
    assert "ratio relaympi/decent-dp:complete: ms/step 1.50 [1.50-1.50]x, CPU 0.50" in text
    assert text.endswith("fastest peer (median ms/step): decent-dp:complete")
    assert "  decent-dp:complete 2 [2-2]" in text


def test_comm_figures_are_medians_after_the_warm_up_of_rank_0_and_the_slowest():
    # 20 exchanges: the first 2 are the warm-up (huge, left out)
    rank0 = [9.0, 9.0] + [0.001 * (k + 1) for k in range(18)]
    rank1 = [9.0, 9.0] + [0.001 * (18 - k) for k in range(18)]
    ours, slowest = peers.comm_summary([rank0, rank1])
    assert ours == pytest.approx(9.5)  # median of 1..18 ms
    assert slowest == pytest.approx(14.0)  # maxima 18, 17, ..., 10, 10, ..., 18: median 14
    text = peers.comm_report(
        "allreduce:gloo",
        1000,
        2,
        [
            (
                peers.CommMeasure("relaympi", 1.0, 2.0, 4e3, False),
                peers.CommMeasure("gloo", 4.0, 4.0, 4e3, True),
            )
        ],
    )
    assert "ratio relaympi/peer: rank 0 0.25 [0.25-0.25]x, slowest 0.50 [0.50-0.50]x" in text
    assert "1,000 float32 (0.004 MB) per rank, 2 ranks" in text


@pytest.mark.slow
@requires_mpirun
def test_comm_only_runs_count_one_buffer_per_exchange_at_two_ranks(tmp_path):
    """Two ranks: one gossip exchange sends the buffer once; the tree all-reduce sends it once
    (its one stage); gloo's ring all-reduce is estimated at 2 (n - 1) / n buffers, one."""
    for system in ("relaympi", "gloo"):
        for op in ("gossip", "allreduce"):
            if (system, op) == ("gloo", "gossip"):
                pytest.importorskip("decent_dp")
            figures = peers.run_comm(system, op, 1000, 2, 4, tmp_path)
            assert figures["bytes_per_step"] == 4000, (system, op)
            assert figures["estimated"] == (system == "gloo")
            assert len(figures["times"]) == 2 and len(figures["times"][0]) == 4
            assert all(t > 0 for row in figures["times"] for t in row)


def test_relay_and_decent_dp_train_at_the_other_pairs_lr():
    """Both systems of relay:decent-dp read their lr from the same flags; it is the lr the plan
    gives the other pairs, not RelaySGD's own (at which Decent-DP diverges)."""
    from relaympi.config import parse_args
    from relaympi.training.plan import resolve

    def lr(algo: str, topology: str | None) -> float:
        plan = resolve(parse_args(peers.train_args(algo, topology, 100)), 4)
        return plan.schedule(100).lr_at(0)

    assert lr("relay", None) == peers.RELAY_PAIR_LR
    assert lr("dpsgd", "alternating-ring") == lr("allreduce", None) == peers.RELAY_PAIR_LR

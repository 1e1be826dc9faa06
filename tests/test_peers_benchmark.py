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

"""One flag table: RunConfig's Flags generate the parser, refusals, identity and resume keys and
docs/running.md's table; value checks live in the domain classes; the launcher's environment is
read in one function."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from relaympi import config
from relaympi.config import (
    FLAGS,
    NON_SEMANTIC_KEYS,
    RESUME_FREE_KEYS,
    ConfigError,
    RunConfig,
    flag_table,
    parse_args,
)
from tests.conftest import ROOT

LOCAL = ["--backend", "local", "--workers", "2", "--steps", "2"]


# ------------------------------------------------------------------------------ the flag table
# (docs/running.md's copy of it: tests/test_doc_tables.py)


def test_every_flag_is_in_the_parser_and_the_readme_table() -> None:
    options = {s for a in config.build_parser()._actions for s in a.option_strings}
    table = flag_table()
    for f, flag in FLAGS:
        assert flag.option_string(f.name) in options, f.name
        assert f"`{flag.option_string(f.name)}" in table, f.name
    assert {f.name for f, _ in FLAGS} == {f.name for f in dataclasses.fields(RunConfig)} - {"extra"}


def test_readme_names_every_key_that_cannot_change_a_runs_numbers() -> None:
    """docs/running.md's sentence on experiments lists NON_SEMANTIC_KEYS (it had left out
    relay_chunk)."""
    text = " ".join((ROOT / "docs" / "running.md").read_text(encoding="utf-8").split())
    sentence = text[
        text.index("the keys that cannot are") : text.index("(`relaympi.config.NON_SEMANTIC_KEYS`)")
    ]
    assert set(re.findall(r"`(\w+)`", sentence)) == NON_SEMANTIC_KEYS


def test_resume_free_keys_are_metadata_and_cannot_change_the_numbers() -> None:
    from relaympi.training.checkpointing import resume_key

    assert set(RESUME_FREE_KEYS) == {
        "out",
        "overwrite",
        "checkpoint_dir",
        "backend",
        "workers",
        "log_every",
        "threads",
        "loader_workers",
        "device",
        "eval_batch_size",
        "overlap",
        "progress_thread",
        "progress_interval",
        "bucket_size",
        "on_failure",
        "peer_timeout",
    }
    # what a resumed run may change never changes its numbers
    assert set(RESUME_FREE_KEYS) <= NON_SEMANTIC_KEYS
    key = resume_key(RunConfig(threads=3, relay_chunk=64))
    # chunks are checkpointed state: they must match
    assert "threads" not in key and key["relay_chunk"] == 64


def test_a_new_field_with_its_flag_gets_parser_refusal_identity_and_table(monkeypatch) -> None:
    """Adding one field (here: a made-up option of RelaySGD's) is all a flag needs; being a field
    of RelaySGD's options is all it takes to apply to --algo relay only."""
    from relaympi.algorithms.options import RelaySGDOptions, option
    from relaympi.config import flags, run_config
    from relaympi.registry import Registry

    extra = config.flag_field(None, "a made-up option (default none)", type=int, numbers=True)
    Made = dataclasses.make_dataclass(
        "Made", [("made_up", int | None, extra)], bases=(RunConfig,), frozen=True
    )
    MadeOptions = dataclasses.make_dataclass(
        "MadeOptions",
        [("made_up", int | None, option(None))],
        bases=(RelaySGDOptions,),
        frozen=True,
    )
    monkeypatch.setattr(run_config, "FLAGS", config.flags_of(Made))
    options = {**flags.ALGORITHM_OPTIONS, "relay": MadeOptions}
    monkeypatch.setattr(flags, "ALGORITHM_OPTIONS", Registry("algorithm", options))
    shown = " ".join(config.build_parser().format_help().split())
    assert "--made-up MADE_UP --algo relay only: a made-up option (default none)" in shown
    assert (
        "| `--made-up MADE_UP` | `--algo relay` only: a made-up option (default none) |"
        in config.flag_table()
    )
    assert config.not_applicable(Made(algo="dpsgd", made_up=3)) == [
        ("--made-up", "it applies to --algo relay only, not dpsgd")
    ]
    assert config.not_applicable(Made(algo="relay", made_up=3)) == []
    assert "made_up" not in config.experiment_settings({"algo": "dpsgd", "made_up": 3})
    assert config.experiment_settings({"algo": "relay", "made_up": 3})["made_up"] == 3


def test_an_algorithms_options_are_refused_for_the_others_naming_what_they_do() -> None:
    """Where an algorithm's option applies comes from the algorithms' options classes."""
    from relaympi.config.flags import algorithms_taking

    assert algorithms_taking("relay_chunk") == ("relay", "relay-grad") and algorithms_taking(
        "d2_force"
    ) == ("d2",)
    assert algorithms_taking("seed") == ()
    why = dict(
        config.not_applicable(
            RunConfig(algo="sgp", relay_chunk=8, relay_mode="previous", d2_force=True)
        )
    )
    assert why == {
        "--relay-mode": "it is RelaySGD's normalization (--algo relay), not used by sgp",
        "--relay-chunk": "it sizes RelaySum's message chunks (relay, relay-grad), not used by sgp",
        "--d2-force": "it applies to --algo d2 only, not sgp",
    }


# --------------------------------------------------------------- value checks in domain classes

# (flags, the error line): the messages are those of the checks config.py made itself before
DOMAIN_CASES = [
    (["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    (["--drop-prob", "1.5"], "--drop-prob must be in [0, 1), got 1.5"),
    (["--relay-chunk", "0"], "--relay-chunk must be a positive number of elements, got 0"),
    (["--task", "quadratics", "--mu", "2"], "need 0 < --mu <= --L, got mu=2.0, L=1.0"),
    (["--task", "quadratics", "--dim", "0"], "--dim must be >= 1, got 0"),
    (["--task", "quadratics", "--zeta2", "inf"], "--zeta2 must be >= 0 and finite, got inf"),
]


@pytest.mark.parametrize("flags, message", DOMAIN_CASES, ids=[c[0][-2] for c in DOMAIN_CASES])
def test_a_domain_classes_check_is_a_usage_error_naming_the_flag(flags, message) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args([*LOCAL, *flags])
    assert str(info.value) == message


def test_a_saved_config_is_checked_by_the_domain_classes_too(tmp_path: Path) -> None:
    """Values the parser's choices never see (a --config file) are refused by the domain class,
    naming the flag."""
    saved = tmp_path / "c.json"
    saved.write_text('{"relay_mode": "median", "optimizer": "adamw"}')
    with pytest.raises(ConfigError, match=r"unknown --optimizer 'adamw'; choose one of sgd, adam"):
        parse_args([*LOCAL, "--config", str(saved)])
    saved.write_text('{"relay_mode": "median"}')
    with pytest.raises(
        ConfigError, match=r"unknown --relay-mode 'median'; choose one of counts, previous, initial"
    ):
        parse_args([*LOCAL, "--config", str(saved)])


def test_domain_classes_refuse_their_own_bad_values() -> None:
    from relaympi.algorithms import AlgorithmOptions
    from relaympi.tasks.quadratics import QuadraticsSpec

    with pytest.raises(ValueError, match="relay_mode"):
        AlgorithmOptions(relay_mode="median")
    with pytest.raises(ValueError, match="relay_chunk"):
        AlgorithmOptions(relay_chunk=0)
    with pytest.raises(ValueError, match="zeta2 must be >= 0 and finite"):
        QuadraticsSpec(zeta2=math.inf)
    assert AlgorithmOptions.of(
        {"relay_mode": None, "relay_chunk": 8, "other": 1}
    ) == AlgorithmOptions(relay_chunk=8)


def test_a_domain_check_reaches_the_command_line(monkeypatch) -> None:
    """validate asks the domain class (a stricter DropPolicy is at once the CLI's rule)."""
    from relaympi.comm import base

    original = base.DropPolicy.__init__

    def at_most_a_half(self, prob: float = 0.0, seed: int = 0) -> None:
        if prob > 0.5:
            raise ValueError(f"drop probability must be <= 0.5, got {prob}")
        original(self, prob, seed)

    monkeypatch.setattr(base.DropPolicy, "__init__", at_most_a_half)
    with pytest.raises(ConfigError, match=r"^--drop-prob must be <= 0.5, got 0.6$"):
        parse_args([*LOCAL, "--drop-prob", "0.6"])


# ---------------------------------------------------------------------------- the plan carries


def test_the_plan_carries_drops_task_options_and_algorithm_options() -> None:
    from relaympi.training.plan import resolve

    cfg = parse_args(
        [
            *LOCAL,
            "--drop-prob",
            "0.25",
            "--seed",
            "7",
            "--eval-batch-size",
            "64",
            "--relay-chunk",
            "128",
        ]
    )
    plan = resolve(cfg, 2)
    assert (plan.drops.prob, plan.drops.seed) == (0.25, 7)
    assert (
        plan.task_options.seed,
        plan.task_options.eval_batch_size,
        plan.task_options.device,
    ) == (7, 64, "cpu")
    assert (
        plan.algorithm_options.relay_chunk == 128 and plan.algorithm_options.relay_mode == "counts"
    )


def test_engines_build_no_drop_policy_or_task_options_of_their_own() -> None:
    # config's validation builds a DropPolicy to check --drop-prob; the MPI communicator exists
    # before the plan
    # (the ranks agree on resolve's errors through it), so train.py's MPI path still builds its own
    allowed = {"plan.py": 3, "validation.py": 1, "train.py": 1}
    for path in sorted((ROOT / "relaympi").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        made = text.count("DropPolicy(cfg.") + text.count("task_options(cfg")
        assert made <= allowed.get(path.name, 0), path


# ------------------------------------------------------------------------------ the launcher

MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_RANK": "5",
}
SRUN = {
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NTASKS": "8",
    "PMIX_RANK": "6",
    "PMIX_SIZE": "8",
    "SLURMD_NODENAME": "node3",
}
BATCH_SCRIPT = {
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_ID": "12",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (False, 0, 1, None, None)),
        (MPICH, (True, 3, 4, 1, 2)),
        (OPEN_MPI, (True, 5, 8, 1, 4)),
        (SRUN, (True, 6, 8, 2, None)),
        (BATCH_SCRIPT, (False, 0, 1, 0, None)),  # a batch script is no rank of an 8-task world
        # mpirun -n 1: launched, one rank
        ({"PMI_RANK": "0", "PMI_SIZE": "1"}, (True, 0, 1, None, None)),
    ],
    ids=["plain", "mpich", "open-mpi", "srun", "batch-script", "mpirun-n-1"],
)
def test_launch_reads_rank_size_and_local_rank(env, expected) -> None:
    from relaympi.launcher import launch

    got = launch(env)
    assert (got.launched, got.rank, got.size, got.local_rank, got.local_size) == expected
    assert got.node == env.get("SLURMD_NODENAME", got.node) and got.node


def test_only_the_launcher_reads_the_launchers_variables() -> None:
    from relaympi import launcher

    names = {
        *launcher.RANK_VARIABLES,
        *launcher.SIZE_VARIABLES,
        *launcher.LOCAL_RANK_VARIABLES,
        *launcher.LOCAL_SIZE_VARIABLES,
    }
    for path in [
        *sorted((ROOT / "relaympi").rglob("*.py")),
        *sorted((ROOT / "benchmarks").rglob("*.py")),
    ]:
        if path.name == "launcher.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert not [n for n in names if f'"{n}"' in text], path


def test_device_and_backend_checks_follow_the_launcher(monkeypatch, capsys) -> None:
    from relaympi import train
    from relaympi.training.loop import device_for

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    # rank 0 prints the error
    for var, value in {**SRUN, "SLURM_PROCID": "0", "PMIX_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    assert device_for(RunConfig(device="cuda"), rank=6) == "cuda:0"  # SLURM_LOCALID 2 on 2 GPUs
    assert train.main(LOCAL) == 2
    assert "one of 8 MPI ranks" in capsys.readouterr().err

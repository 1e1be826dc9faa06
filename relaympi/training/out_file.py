"""What --out may replace, decided from the file (and the plan, for a preempted run): no torch or
MPI needed, so the trainer refuses a finished run file before it loads either (under mpirun each
rank loads torch, for most of a minute on a busy node)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relaympi.config import ConfigError, experiment_settings
from relaympi.results import (
    FINISHED_STATUSES,
    RESUMABLE_STATUSES,
    file_kind,
    read_run,
    run_status,
)
from relaympi.results.schema import QUADRATICS_CONVENTION_ATTR
from relaympi.results.writer import in_use
from relaympi.tasks.quadratics import CONVENTION

if TYPE_CHECKING:
    from relaympi.training.plan import Plan


def check_out(out: Path, overwrite: bool, plan: Plan | None = None) -> None:
    """Refuse (ConfigError) an --out this run may not replace, before anything is written: --out
    replaces only run files (a finished one, a damaged one, a preempted run of another
    configuration than ``plan``'s, or an unfinished quadratics run of the older 1/2 loss, only
    with --overwrite).

    Args:
        out: the run file's path.
        overwrite: --overwrite was given.
        plan: the run's plan, to compare with a preempted run's configuration; None (before the
            plan is resolved): every check but that one.

    Raises:
        ConfigError: ``out`` may not be replaced; the message says why and what to do.
    """
    kind = file_kind(out)
    if kind == "other":
        raise ConfigError(
            f"--out {out} exists and is not a relaympi run file; --out replaces only run "
            "files (even with --overwrite): "
            "choose another --out, or move that file away"
        )
    if kind == "damaged" and not overwrite:
        raise ConfigError(
            f"--out {out} exists but cannot be read as a run file (empty or damaged HDF5); "
            "pass --overwrite to replace it, or choose another --out"
        )
    if kind == "run":
        refuse_finished_run(out, overwrite)
    if (
        kind == "run"
        and not overwrite
        and plan is not None
        and plan.problem is not None
        and run_status(out) in RESUMABLE_STATUSES
        and not in_use(out)  # a live run's file: the writer refuses it, naming that
        and read_run(out).attrs.get(QUADRATICS_CONVENTION_ATTR) != CONVENTION
    ):
        raise ConfigError(
            f"{out} holds an unfinished quadratics run of an older relaympi (loss "
            "1/2 ||A_i x - b_i||^2, no quadratics_convention); it cannot go on under "
            f"{CONVENTION!r}: pass --overwrite to start it again, or choose another --out"
        )
    if kind == "run" and not overwrite and plan is not None and run_status(out) == "preempted":
        differ = _differences(read_run(out).config, plan)
        if differ:
            raise ConfigError(
                f"{out} holds a preempted run of another configuration ({differ}); pass "
                "--overwrite to replace it, or choose another --out"
            )


def refuse_finished_run(out: Path, overwrite: bool) -> None:
    """Refuse (ConfigError) to replace a finished run (completed or diverged) without --overwrite.

    Args:
        out: the run file's path (nothing there, or any file, passes: check_out judges those).
        overwrite: --overwrite was given.

    Raises:
        ConfigError: ``out`` holds a finished run and ``overwrite`` is False.
    """
    if not overwrite and file_kind(out) == "run" and run_status(out) in FINISHED_STATUSES:
        raise ConfigError(f"{out} already holds a finished run; pass --overwrite to replace it")


def _differences(saved: dict[str, Any], plan: Plan) -> str:
    """How the experiment in a run file's ``saved`` config differs from ``plan``'s ('' if it does
    not): its settings (relaympi.config.experiment_settings) and its worker count."""
    mine = plan.cfg.to_dict() | {"world_size": plan.world_size}
    theirs, ours = experiment_settings(saved), experiment_settings(mine)
    theirs["world_size"], ours["world_size"] = saved.get("world_size"), plan.world_size
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    words = [
        f"{key} {json.dumps(theirs.get(key))} there, {json.dumps(ours.get(key))} here"
        for key in keys[:3]
    ]
    return "; ".join(words) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")

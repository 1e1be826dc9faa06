"""The table of studies: each one's settings (the paper's, or the reduced --quick ones) and how it
runs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaympi.studies.quadratics.dme import DmeSettings, study_dme
from relaympi.studies.quadratics.fig2 import Fig2Settings, draw_fig2, study_fig2
from relaympi.studies.quadratics.findings import StudyResult
from relaympi.studies.quadratics.heterogeneity import (
    STAR,
    HeterogeneitySettings,
    study_heterogeneity,
)
from relaympi.studies.quadratics.lr_correction import LrCorrectionSettings, study_lr_correction
from relaympi.studies.quadratics.social import SocialSettings, study_social
from relaympi.studies.quadratics.tuning import SearchConfig

QUICK_SEARCH = {"grid_points": 10, "rounds": 1, "round_points": 5, "max_steps": 2000}


@dataclass(frozen=True)
class Study:
    """One study: the paper's settings, the changes --quick makes to them, and its run (settings,
    seed)."""

    settings: Any
    quick: dict[str, Any]
    run: Callable[[Any, int], StudyResult]
    quick_search: dict[str, Any] = field(default_factory=dict)  # beyond QUICK_SEARCH, with --quick
    # the study's figure: drawn into the output directory, returns the file's path
    figure: Callable[[StudyResult, Path], Path] | None = None


def _heterogeneity(settings: HeterogeneitySettings) -> Study:
    # --quick: noise-free only (the social study's quick run covers gradient noise)
    return Study(
        settings,
        {"n": 8, "zeta2_values": (0.0, max(settings.zeta2_values)), "sigma2_values": (0.0,)},
        lambda s, seed: study_heterogeneity(s),
    )


TABLE: dict[str, Study] = {
    "fig2": Study(
        Fig2Settings(),
        {"n_values": (4, 8), "zeta2_values": (0.0, 0.01, 1.0)},
        lambda s, seed: study_fig2(s),
        figure=draw_fig2,
    ),
    "heterogeneity": _heterogeneity(HeterogeneitySettings()),
    "star": _heterogeneity(STAR),
    "social": Study(
        SocialSettings(),
        {"roots": (0, 21)},
        lambda s, seed: study_social(s),
        quick_search={"noise_seeds": 2, "max_steps": 3000},
    ),
    "dme": Study(
        DmeSettings(),
        {"n_values": (8,), "checkpoints": (1, 4, 16, 64), "repetitions": 200},
        study_dme,
    ),
    "lr-correction": Study(
        LrCorrectionSettings(),
        {"n_values": (4, 16)},
        lambda s, seed: study_lr_correction(s),
    ),
}
STUDIES = tuple(TABLE)


QUICK_SEEDS = 2  # --quick: seeds of a study that runs several


def settings_for(
    study: str, quick: bool, seed: int, max_steps: int | None, seeds: int | None = None
) -> Any:
    """The settings of one study: the paper's setup, or the reduced --quick one.

    Args:
        study: its name (STUDIES).
        quick: the reduced settings.
        seed: the problem and noise seed (a study over several seeds: the first).
        max_steps: the cap on steps per run (None: the study's).
        seeds: how many seeds a study over several runs (None: its default, QUICK_SEEDS with
            ``quick``); the others run one.

    Returns:
        The study's settings.
    """
    if study not in TABLE:
        raise ValueError(f"unknown study {study!r}; choose one of {', '.join(STUDIES)} or all")
    entry = TABLE[study]
    settings = dataclasses.replace(entry.settings, **entry.quick) if quick else entry.settings
    if hasattr(settings, "seeds"):
        count = seeds if seeds is not None else QUICK_SEEDS if quick else len(settings.seeds)
        settings = dataclasses.replace(settings, seeds=tuple(range(seed, seed + count)))
    if not isinstance(getattr(settings, "search", None), SearchConfig):
        return settings  # no learning-rate search: seed and max_steps do not apply
    changes: dict[str, Any] = {"seed": seed}
    if quick:
        changes.update(QUICK_SEARCH, **entry.quick_search)
    if max_steps is not None:
        changes["max_steps"] = max_steps
    return dataclasses.replace(settings, search=dataclasses.replace(settings.search, **changes))


def run_study(
    study: str,
    quick: bool = False,
    seed: int = 0,
    max_steps: int | None = None,
    seeds: int | None = None,
) -> StudyResult:
    """Run one study (settings_for's arguments) and time it."""
    settings = settings_for(study, quick, seed, max_steps, seeds)
    start = time.perf_counter()
    result = TABLE[study].run(settings, seed)
    result.elapsed_s = time.perf_counter() - start
    return result

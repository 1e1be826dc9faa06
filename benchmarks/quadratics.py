"""Random-quadratics studies of the paper: tuned steps to a target suboptimality, spanning trees, mean estimation.

    python -m benchmarks.quadratics fig2                  # Figure 2: steps to 1e-6 vs n (ring, trees, exponential)
    python -m benchmarks.quadratics heterogeneity         # appendix "Independence of heterogeneity" (n=32 ring/chain)
    python -m benchmarks.quadratics star                  # appendix "Star topology" (n=32)
    python -m benchmarks.quadratics social                # Figure 3: spanning trees of the social network
    python -m benchmarks.quadratics dme                   # appendix "RelaySum for distributed mean estimation"
    python -m benchmarks.quadratics lr-correction         # appendix "Learning-rate correction", measured
    python -m benchmarks.quadratics all --quick --out /tmp/q   # every study, reduced (< 1 minute)

Every optimization study runs the matrix engine (relaympi.algorithms.matrix) with plain local
SGD from x(0) = 0 and tunes a constant learning rate per (method, setting): the one that
reaches the target suboptimality f(x_bar) - f* in the fewest steps, searched on a log scale
(benchmarks._tuning.SearchConfig), with at most --max-steps gradient steps (default 20,000).
A method that does not reach the target within the cap is reported as "n.r." with the lowest
suboptimality it reached (its plateau). With gradient noise, "reached" means the suboptimality
averaged over several noise streams (common to all learning rates) is below the target.

Each study writes <out>/<study>.h5 (h5py) and prints its tables, the paper's findings that
hold or do not, and its wall time. File layout: root attributes `kind` ("quadratics-study"),
`schema_version` (1), `study`, `settings` (JSON), `provenance` (JSON, relaympi.provenance),
`findings` (JSON list), `elapsed_s`; group `table` holds one dataset per column of the
study's table (one entry per row); `curves/<i>` holds row i's suboptimality per step at its
tuned learning rate and `trials/<i>` every learning rate its search tried [lr, steps to target
or -1, lowest suboptimality]; group `data` holds study-specific arrays (DME: MSE per checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks._tuning import Method, SearchConfig, Tuned, d2_method, tune
from relaympi.algorithms.matrix import make_matrix_algorithm
from relaympi.optim import OptimizerConfig
from relaympi.tasks.quadratics import Quadratics, QuadraticsSpec, generate
from relaympi.topology import Topology, build, lr_correction, spanning_tree

log = logging.getLogger("benchmarks.quadratics")

SCHEMA_VERSION = 1
STUDIES = ("fig2", "heterogeneity", "star", "social", "dme", "lr-correction")
DEFAULT_OUT = Path("bench-results/quadratics")
EXACT_DIFFUSION_MARK = (
    "+"  # table marker: D² ran with (W + I) / 2 because W's smallest eigenvalue is < -1/3
)


# ---------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class ProblemSettings:
    """Random quadratics of the paper's appendix; the global optimum is x* with ||x*|| = r0, x(0) = 0."""

    dim: int = 10  # even, so double binary trees relay the same number of coordinates on each tree
    mu: float = 0.5  # smallest singular value of every A_i (Hessian eigenvalues >= mu^2)
    L: float = 1.0  # largest singular value of every A_i
    r0: float = 10.0


@dataclass(frozen=True)
class Fig2Settings:
    problem: ProblemSettings = ProblemSettings()
    n_values: tuple[int, ...] = (4, 8, 16, 32, 64)
    # The figure's two panels differ in heterogeneity; the text gives no values. zeta2 = 0 makes every
    # worker's own optimum x*, so no communication is needed at all; 1 and 10 are heterogeneous panels.
    zeta2_values: tuple[float, ...] = (0.0, 1.0, 10.0)
    search: SearchConfig = SearchConfig(
        target=1e-6
    )  # target suboptimality, learning-rate search, step cap


@dataclass(frozen=True)
class HeterogeneitySettings:
    """Appendix "Independence of heterogeneity" (ring, chain for RelaySGD) and "Star topology"."""

    topology: str = "ring"  # "ring" (RelaySGD on a chain) or "star"
    problem: ProblemSettings = ProblemSettings()
    n: int = 32
    zeta2_values: tuple[float, ...] = (0.0, 1.0, 10.0)
    # The paper's figure adds gradient noise; its level is not given. At 3e-3 the noise, not the
    # topology, limits every method's learning rate; 1e-3 is in between; 0 is noise-free.
    sigma2_values: tuple[float, ...] = (0.0, 1e-3, 3e-3)
    search: SearchConfig = SearchConfig(target=1e-6, noise_seeds=4)


@dataclass(frozen=True)
class SocialSettings:
    """Figure 3: RelaySGD on spanning trees of the Davis Southern Women graph vs D² / DP-SGD on the graph."""

    problem: ProblemSettings = ProblemSettings(r0=1.0)
    zeta2: float = 0.1
    # the paper's noise level, and a noise-free variant (at sigma2 = 0.1 the noise sets every method's lr)
    sigma2_values: tuple[float, ...] = (0.1, 0.0)
    roots: tuple[int, ...] = (0, 7, 14, 21, 28)  # Spanning Tree Protocol roots: one tree each
    search: SearchConfig = SearchConfig(target=1e-5, noise_seeds=8)


@dataclass(frozen=True)
class DmeSettings:
    """Appendix "RelaySum for distributed mean estimation": samples ~ N(1, 1), d = 1."""

    n_values: tuple[int, ...] = (16, 32)
    checkpoints: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    repetitions: int = 1000
    mean: float = 1.0
    chunk: int = 100  # repetitions simulated at once (memory: chunk x T x n floats)


@dataclass(frozen=True)
class LrCorrectionSettings:
    topologies: tuple[str, ...] = ("chain", "binary-tree", "double-binary-trees", "star")
    n_values: tuple[int, ...] = (4, 16, 64)
    tolerance: float = (
        1e-10  # stop once every value of the last tau_max + 1 steps lies within this relative width
    )


QUICK_SEARCH = {"grid_points": 10, "rounds": 1, "round_points": 5, "max_steps": 2000}


def settings_for(study: str, quick: bool, seed: int, max_steps: int | None) -> Any:
    """The settings of one study: the paper's setup, or the reduced --quick one."""

    def search(base: SearchConfig, **quick_changes: Any) -> SearchConfig:
        changes: dict[str, Any] = {"seed": seed}
        if quick:
            changes.update(QUICK_SEARCH, **quick_changes)
        if max_steps is not None:
            changes["max_steps"] = max_steps
        return dataclasses.replace(base, **changes)

    if study == "fig2":
        s = Fig2Settings()
        if quick:
            s = dataclasses.replace(s, n_values=(4, 8), zeta2_values=(0.0, 10.0))
        return dataclasses.replace(s, search=search(s.search))
    if study in ("heterogeneity", "star"):
        s = HeterogeneitySettings(topology="ring" if study == "heterogeneity" else "star")
        if quick:  # noise-free only: the social study's quick run covers gradient noise
            s = dataclasses.replace(s, n=8, zeta2_values=(0.0, 10.0), sigma2_values=(0.0,))
        return dataclasses.replace(s, search=search(s.search))
    if study == "social":
        s = SocialSettings()
        if quick:
            s = dataclasses.replace(s, roots=(0, 21))
        return dataclasses.replace(s, search=search(s.search, noise_seeds=2, max_steps=3000))
    if study == "dme":
        return (
            DmeSettings(n_values=(8,), checkpoints=(1, 4, 16, 64), repetitions=200)
            if quick
            else DmeSettings()
        )
    if study == "lr-correction":
        return LrCorrectionSettings(n_values=(4, 16)) if quick else LrCorrectionSettings()
    raise ValueError(f"unknown study {study!r}; choose one of {', '.join(STUDIES)} or all")


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Finding:
    """One of the paper's qualitative claims, checked against this study's numbers."""

    claim: str
    holds: bool
    evidence: str

    def line(self) -> str:
        return f"{self.claim}: {'yes' if self.holds else 'NO'} ({self.evidence})"


@dataclass
class StudyResult:
    study: str
    settings: Any
    rows: list[dict[str, Any]] = field(
        default_factory=list
    )  # the table, one row per run or measurement
    curves: list[np.ndarray | None] = field(default_factory=list)  # per row: suboptimality per step
    trials: list[np.ndarray | None] = field(
        default_factory=list
    )  # per row: every learning rate the search tried
    tables: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    data: dict[str, np.ndarray] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def add(self, row: dict[str, Any], tuned: Tuned | None = None) -> None:
        self.rows.append(row)
        self.curves.append(None if tuned is None else tuned.curve)
        self.trials.append(None if tuned is None else tuned.trials)


def _tuned_row(method: Method, tuned: Tuned, **setting: Any) -> dict[str, Any]:
    return {
        "method": method.label,
        "algo": method.algo,
        "topology": method.topology.name,
        **setting,
        "d2_exact_diffusion": method.d2_exact_diffusion,
        "lr": tuned.lr,
        "steps": tuned.steps if tuned.reached else -1,
        "reached": tuned.reached,
        "best_suboptimality": tuned.best_suboptimality,
        "lr_at_search_boundary": tuned.at_boundary,
        "wall_s": tuned.wall_s,
    }


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    mark = EXACT_DIFFUSION_MARK if row.get("d2_exact_diffusion") else ""
    if row["reached"]:
        return f"{row['steps']}{mark}"
    return f"n.r. {row['best_suboptimality']:.1e}{mark}"


def _grid(
    title: str,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    cells: Callable[[str, str], str],
) -> str:
    """A plain-text table: one row per row label, one column per column label."""
    body = [[cells(r, c) for c in col_labels] for r in row_labels]
    first = max(len(title), *(len(r) for r in row_labels))
    widths = [max(len(c), *(len(line[k]) for line in body)) for k, c in enumerate(col_labels)]
    lines = [
        f"{title:<{first}}  "
        + "  ".join(f"{c:>{w}}" for c, w in zip(col_labels, widths, strict=True))
    ]
    lines.append("-" * len(lines[0]))
    for label, line in zip(row_labels, body, strict=True):
        lines.append(
            f"{label:<{first}}  "
            + "  ".join(f"{v:>{w}}" for v, w in zip(line, widths, strict=True))
        )
    return "\n".join(lines)


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _steps(rows: list[dict[str, Any]], **match: Any) -> int | None:
    row = _find(rows, **match)
    return row["steps"] if row is not None and row["reached"] else None


def _fmt(steps: int | None) -> str:
    return "n.r." if steps is None else str(steps)


def _exponent(ns: Sequence[int], steps: Sequence[int | None]) -> float | None:
    """Slope of log(steps) against log(n) (least squares); None if some setting did not reach the target."""
    if any(s is None for s in steps) or len(ns) < 2:
        return None
    return float(np.polyfit(np.log(ns), np.log(np.asarray(steps, dtype=float)), 1)[0])


def _ratio_within(values: Sequence[int | None], tolerance: float) -> tuple[bool, float | None]:
    """Whether max/min <= 1 + tolerance, and the ratio (None if some setting did not reach the target)."""
    if not values or any(v is None for v in values):
        return False, None
    ratio = max(values) / min(values)
    return ratio <= 1.0 + tolerance, ratio


def _problem(n: int, p: ProblemSettings, zeta2: float, sigma2: float, seed: int) -> Quadratics:
    return generate(
        n, QuadraticsSpec(dim=p.dim, mu=p.mu, L=p.L, zeta2=zeta2, r0=p.r0, sigma2=sigma2), seed
    )


# ---------------------------------------------------------------------------------------------
# Figure 2: scaling with the number of workers


def _fig2_methods(n: int) -> list[Method]:
    ring, tree = build("ring", n), build("binary-tree", n)
    return [
        Method("RelaySGD chain", "relay", build("chain", n)),
        Method("RelaySGD binary-tree", "relay", tree),
        Method("RelaySGD double-binary-trees", "relay", build("double-binary-trees", n)),
        d2_method("D2 ring", ring),
        d2_method("D2 binary-tree", tree),
        Method("GT ring", "gt", ring),
        Method("GT binary-tree", "gt", tree),
        Method("DP-SGD ring", "dpsgd", ring),
        Method("DP-SGD binary-tree", "dpsgd", tree),
        Method("SGP exponential", "sgp", build("exponential", n)),
        Method("all-reduce (reference)", "allreduce", build("fully-connected", n)),
    ]


def study_fig2(s: Fig2Settings) -> StudyResult:
    result = StudyResult("fig2", s)
    for zeta2 in s.zeta2_values:
        for n in s.n_values:
            problem = _problem(n, s.problem, zeta2, 0.0, s.search.seed)
            for method in _fig2_methods(n):
                tuned = tune(problem, method, s.search)
                log.info(
                    "fig2 zeta2=%g n=%d %s: %s steps (lr %.3g, %.1fs)",
                    zeta2,
                    n,
                    method.label,
                    _fmt(tuned.steps),
                    tuned.lr,
                    tuned.wall_s,
                )
                result.add(_tuned_row(method, tuned, n=n, zeta2=zeta2, sigma2=0.0), tuned)
    labels = [m.label for m in _fig2_methods(4)]
    columns = [f"n={n}" for n in s.n_values]
    for zeta2 in s.zeta2_values:
        result.tables.append(
            _grid(
                f"steps to {s.search.target:g}, zeta2={zeta2:g}",
                labels,
                columns,
                lambda label, c, z=zeta2: _cell(
                    _find(result.rows, method=label, zeta2=z, n=int(c[2:]))
                ),
            )
        )
        result.tables.append(
            _grid(
                f"tuned lr, zeta2={zeta2:g}",
                labels,
                columns,
                lambda label, c, z=zeta2: (
                    f"{_find(result.rows, method=label, zeta2=z, n=int(c[2:]))['lr']:.3g}"
                ),
            )
        )
    result.tables.append(
        f"{EXACT_DIFFUSION_MARK}: D2 with (W+I)/2 (MH matrix has smallest eigenvalue < -1/3); n.r.: not reached within {s.search.max_steps} steps, lowest suboptimality shown"
    )
    result.findings = _fig2_findings(result.rows, s)
    return result


def _fig2_findings(rows: list[dict[str, Any]], s: Fig2Settings) -> list[Finding]:
    ns = list(s.n_values)
    hetero = [z for z in s.zeta2_values if z > 0]
    z_max = max(s.zeta2_values)

    def series(label: str, zeta2: float) -> list[int | None]:
        return [_steps(rows, method=label, zeta2=zeta2, n=n) for n in ns]

    def show(label: str, zeta2: float) -> str:
        return "/".join(_fmt(v) for v in series(label, zeta2))

    findings = []
    large = [n for n in ns if n >= 16] or ns
    for label in ("RelaySGD binary-tree", "RelaySGD double-binary-trees"):
        exponent = _exponent(ns, series(label, z_max))
        findings.append(
            Finding(
                f"{label}: steps grow ~log n (zeta2={z_max:g})",
                exponent is not None and exponent < 0.35,
                f"steps {show(label, z_max)} for n={'/'.join(map(str, ns))}; log-log slope {exponent if exponent is None else round(exponent, 2)}, linear growth has 1",
            )
        )
    for label in ("RelaySGD chain", "D2 ring"):
        steps = [_steps(rows, method=label, zeta2=z_max, n=n) for n in large]
        exponent = _exponent(large, steps)
        findings.append(
            Finding(
                f"{label}: steps grow ~linearly (or faster) in n on heterogeneous data (zeta2={z_max:g})",
                exponent is not None and exponent >= 0.7,
                f"steps {'/'.join(map(_fmt, steps))} for n={'/'.join(map(str, large))}; log-log slope {exponent if exponent is None else round(exponent, 2)}",
            )
        )
        if len(hetero) >= 2:
            ok = True
            worst = 1.0
            for n in ns:
                within, ratio = _ratio_within(
                    [_steps(rows, method=label, zeta2=z, n=n) for z in hetero], 0.15
                )
                ok &= within
                worst = max(worst, ratio or math.inf)
            findings.append(
                Finding(
                    f"{label}: steps independent of heterogeneity (zeta2 in {'/'.join(f'{z:g}' for z in hetero)}, within 15%)",
                    ok,
                    "; ".join(
                        f"n={n}: "
                        + "/".join(_fmt(_steps(rows, method=label, zeta2=z, n=n)) for z in hetero)
                        for n in ns
                    )
                    + f"; worst ratio {worst:.2f}",
                )
            )
    if 0.0 in s.zeta2_values and hetero:
        # zeta2 = 0 makes x* every worker's own optimum: no communication needed, so no growth with n
        homogeneous = series("RelaySGD chain", 0.0)
        heterogeneous = series("RelaySGD chain", max(hetero))
        findings.append(
            Finding(
                f"RelaySGD chain: zeta2=0 (no communication needed) takes no more steps than zeta2={max(hetero):g}",
                all(
                    a is not None and (b is None or a <= b)
                    for a, b in zip(homogeneous, heterogeneous, strict=True)
                ),
                f"{show('RelaySGD chain', 0.0)} vs {show('RelaySGD chain', max(hetero))} for n={'/'.join(map(str, ns))}",
            )
        )
    n_max = ns[-1]
    for base in ("D2", "GT"):
        ring, tree = (
            _steps(rows, method=f"{base} ring", zeta2=z_max, n=n_max),
            _steps(rows, method=f"{base} binary-tree", zeta2=z_max, n=n_max),
        )
        findings.append(
            Finding(
                f"{base}: a binary tree does not help it much compared with a ring (n={n_max}, zeta2={z_max:g})",
                ring is not None and (tree is None or tree >= 0.5 * ring),
                f"ring {_fmt(ring)}, binary tree {_fmt(tree)} steps",
            )
        )
    relay, d2, gt = (
        _steps(rows, method=m, zeta2=z_max, n=n_max)
        for m in ("RelaySGD chain", "D2 ring", "GT ring")
    )
    findings.append(
        Finding(
            f"RelaySGD (chain) and D2 (ring) scale significantly better than GT (ring) (n={n_max}, zeta2={z_max:g}, >= 2x fewer steps)",
            relay is not None and d2 is not None and (gt is None or gt >= 2 * max(relay, d2)),
            f"RelaySGD {_fmt(relay)}, D2 {_fmt(d2)}, GT {_fmt(gt)} steps",
        )
    )
    tree_relay, tree_d2 = (
        _steps(rows, method="RelaySGD binary-tree", zeta2=z_max, n=n_max),
        _steps(rows, method="D2 binary-tree", zeta2=z_max, n=n_max),
    )
    findings.append(
        Finding(
            f"RelaySGD beats D2 on binary trees (n={n_max}, zeta2={z_max:g})",
            tree_relay is not None and (tree_d2 is None or tree_relay < tree_d2),
            f"RelaySGD {_fmt(tree_relay)}, D2 {_fmt(tree_d2)} steps",
        )
    )
    # With n <= 4 the schedule's log2(n) <= 2 rounds per step average exactly: SGP is all-reduce there.
    gossiping = [n for n in ns if n > 4]
    if len(gossiping) >= 2:
        sgp = [_steps(rows, method="SGP exponential", zeta2=z_max, n=n) for n in gossiping]
        exponent = _exponent(gossiping, sgp)
        findings.append(
            Finding(
                f"SGP (exponential): steps do not consistently grow with n (zeta2={z_max:g}, n > 4)",
                exponent is not None
                and (exponent < 0.3 or any(b < a for a, b in zip(sgp, sgp[1:], strict=False))),
                f"steps {'/'.join(map(_fmt, sgp))} for n={'/'.join(map(str, gossiping))}; log-log slope {exponent if exponent is None else round(exponent, 2)}",
            )
        )
    z_min = min(s.zeta2_values)
    if z_min < z_max and gossiping:
        pairs = [
            (
                _steps(rows, method="SGP exponential", zeta2=z_min, n=n),
                _steps(rows, method="SGP exponential", zeta2=z_max, n=n),
            )
            for n in gossiping
        ]
        findings.append(
            Finding(
                f"SGP needs more steps with more heterogeneity (zeta2={z_min:g} vs {z_max:g}, every n > 4)",
                all(a is not None and (b is None or b > a) for a, b in pairs),
                "; ".join(
                    f"n={n}: {_fmt(a)} vs {_fmt(b)}"
                    for n, (a, b) in zip(gossiping, pairs, strict=True)
                ),
            )
        )
    return findings


# ---------------------------------------------------------------------------------------------
# Independence of heterogeneity (ring / chain) and the star topology


def _heterogeneity_methods(topology: str, n: int) -> list[Method]:
    if topology == "ring":
        graph = build("ring", n)
        relay = Method("RelaySGD chain", "relay", build("chain", n))
        suffix = "ring"
    elif topology == "star":
        graph = build("star", n)
        relay = Method("RelaySGD star", "relay", graph)
        suffix = "star"
    else:
        raise ValueError(f"topology must be 'ring' or 'star', got {topology!r}")
    return [
        relay,
        d2_method(f"D2 {suffix}", graph),
        Method(f"GT {suffix}", "gt", graph),
        Method(f"DP-SGD {suffix}", "dpsgd", graph),
        Method("all-reduce (reference)", "allreduce", build("fully-connected", n)),
    ]


def study_heterogeneity(s: HeterogeneitySettings) -> StudyResult:
    name = "heterogeneity" if s.topology == "ring" else s.topology
    result = StudyResult(name, s)
    methods = _heterogeneity_methods(s.topology, s.n)
    for sigma2 in s.sigma2_values:
        for zeta2 in s.zeta2_values:
            problem = _problem(s.n, s.problem, zeta2, sigma2, s.search.seed)
            for method in methods:
                tuned = tune(problem, method, s.search)
                log.info(
                    "%s sigma2=%g zeta2=%g %s: %s steps (lr %.3g, %.1fs)",
                    name,
                    sigma2,
                    zeta2,
                    method.label,
                    _fmt(tuned.steps),
                    tuned.lr,
                    tuned.wall_s,
                )
                result.add(_tuned_row(method, tuned, n=s.n, zeta2=zeta2, sigma2=sigma2), tuned)
    labels = [m.label for m in methods]
    columns = [f"zeta2={z:g}" for z in s.zeta2_values]
    for sigma2 in s.sigma2_values:
        noise = f"sigma2={sigma2:g}" + (
            f" ({s.search.noise_seeds} noise streams)" if sigma2 > 0 else ""
        )
        result.tables.append(
            _grid(
                f"n={s.n} {s.topology}, steps to {s.search.target:g}, {noise}",
                labels,
                columns,
                lambda label, c, v=sigma2: _cell(
                    _find(result.rows, method=label, sigma2=v, zeta2=float(c[6:]))
                ),
            )
        )
        result.tables.append(
            _grid(
                f"tuned lr, {noise}",
                labels,
                columns,
                lambda label, c, v=sigma2: (
                    f"{_find(result.rows, method=label, sigma2=v, zeta2=float(c[6:]))['lr']:.3g}"
                ),
            )
        )
    result.tables.append(
        f"n.r.: not reached within {s.search.max_steps} steps, lowest suboptimality shown"
    )
    result.findings = _heterogeneity_findings(result.rows, s, labels)
    return result


def _heterogeneity_findings(
    rows: list[dict[str, Any]], s: HeterogeneitySettings, labels: list[str]
) -> list[Finding]:
    relay, d2, dpsgd = labels[0], labels[1], labels[3]
    findings = []
    z_min, z_max = min(s.zeta2_values), max(s.zeta2_values)
    for sigma2 in s.sigma2_values:
        variant = f"sigma2={sigma2:g}"

        def steps(label: str, zeta2: float, v: float = sigma2) -> int | None:
            return _steps(rows, method=label, sigma2=v, zeta2=zeta2)

        # zeta2 = 0 makes x* every worker's own optimum (no communication needed): also compare zeta2 > 0 alone
        groups = [s.zeta2_values]
        positive = tuple(z for z in s.zeta2_values if z > 0)
        if len(positive) >= 2 and len(positive) < len(s.zeta2_values):
            groups.append(positive)
        for label in (relay, d2):
            for group in groups:
                values = [steps(label, z) for z in group]
                ok, ratio = _ratio_within(values, 0.10)
                findings.append(
                    Finding(
                        f"{label}: same steps for every zeta2 in {'/'.join(f'{z:g}' for z in group)} (within 10%, {variant})",
                        ok,
                        "/".join(map(_fmt, values))
                        + ("" if ratio is None else f"; max/min {ratio:.2f}"),
                    )
                )
        low, high = steps(dpsgd, z_min), steps(dpsgd, z_max)
        findings.append(
            Finding(
                f"{dpsgd}: markedly more steps at zeta2={z_max:g} than at {z_min:g} (>= 2x or not reached, {variant})",
                low is not None and (high is None or high >= 2 * low),
                f"{_fmt(low)} vs {_fmt(high)}",
            )
        )
        pairs = [(steps(relay, z), steps(d2, z)) for z in s.zeta2_values]
        if s.topology == "ring":
            findings.append(
                Finding(
                    f"{relay} is as fast as {d2} (within 25%, {variant})",
                    all(
                        a is not None and b is not None and abs(a / b - 1) <= 0.25 for a, b in pairs
                    ),
                    "; ".join(
                        f"zeta2={z:g}: {_fmt(a)} vs {_fmt(b)}"
                        for z, (a, b) in zip(s.zeta2_values, pairs, strict=True)
                    ),
                )
            )
        else:
            findings.append(
                Finding(
                    f"{relay} is significantly faster than {d2} (<= 2/3 of its steps, {variant})",
                    all(a is not None and (b is None or a <= 2 * b / 3) for a, b in pairs),
                    "; ".join(
                        f"zeta2={z:g}: {_fmt(a)} vs {_fmt(b)}"
                        for z, (a, b) in zip(s.zeta2_values, pairs, strict=True)
                    ),
                )
            )
    return findings


# ---------------------------------------------------------------------------------------------
# Figure 3: spanning trees of the social network


def _bytes_per_step(edges: int, dim: int) -> int:
    """Model bytes sent per step: every edge carries one float64 model in each direction."""
    return edges * 2 * dim * 8


def study_social(s: SocialSettings) -> StudyResult:
    result = StudyResult("social", s)
    graph = build("social-network", 32)
    methods = [
        (Method(f"RelaySGD tree root={r}", "relay", spanning_tree(graph, root=r)), r)
        for r in s.roots
    ]
    methods += [
        (Method("D2 full graph [(W+I)/2]", "d2", graph, d2_exact_diffusion=True), -1),
        (Method("DP-SGD full graph", "dpsgd", graph), -1),
        (Method("all-reduce (reference)", "allreduce", build("fully-connected", 32)), -1),
    ]
    d = s.problem.dim
    for sigma2 in s.sigma2_values:
        problem = _problem(32, s.problem, s.zeta2, sigma2, s.search.seed)
        for method, root in methods:
            tuned = tune(problem, method, s.search)
            log.info(
                "social sigma2=%g %s: %s steps (lr %.3g, %.1fs)",
                sigma2,
                method.label,
                _fmt(tuned.steps),
                tuned.lr,
                tuned.wall_s,
            )
            edges = len(method.topology.edges(0))
            payload = _bytes_per_step(edges, d) if method.algo != "allreduce" else -1
            counters = (
                edges * 2 * 8 if method.algo == "relay" else 0
            )  # RelaySGD's messages carry a float64 counter
            row = _tuned_row(
                method,
                tuned,
                n=32,
                zeta2=s.zeta2,
                sigma2=sigma2,
                root=root,
                diameter=method.topology.diameter,
                edges=edges,
            )
            row.update(
                bytes_per_step=payload,
                bytes_per_step_with_counters=payload + counters if payload >= 0 else -1,
            )
            result.add(row, tuned)
    columns = ["diameter", "edges", "steps", "lr", "bytes/step", "+counters"]
    for sigma2 in s.sigma2_values:

        def cell(label: str, column: str, v: float = sigma2) -> str:
            row = _find(result.rows, method=label, sigma2=v)
            return {
                "diameter": str(row["diameter"]),
                "edges": str(row["edges"]),
                "steps": _cell(row),
                "lr": f"{row['lr']:.3g}",
                "bytes/step": str(row["bytes_per_step"])
                if row["bytes_per_step"] >= 0
                else "(allreduce)",
                "+counters": str(row["bytes_per_step_with_counters"])
                if row["bytes_per_step_with_counters"] >= 0
                else "-",
            }[column]

        noise = f"sigma2={sigma2:g}" + (
            f" ({s.search.noise_seeds} noise streams)" if sigma2 > 0 else ""
        )
        result.tables.append(
            _grid(
                f"social network (32 nodes), zeta2={s.zeta2:g}, {noise}, steps to {s.search.target:g}",
                [m.label for m, _ in methods],
                columns,
                cell,
            )
        )
    result.tables.append(
        f"bytes/step = edges x 2 directions x d={d} x 8 bytes (float64 models); +counters adds RelaySGD's 8-byte counter per message"
    )
    result.findings = [
        f
        for sigma2 in s.sigma2_values
        for f in _social_findings([r for r in result.rows if r["sigma2"] == sigma2], s, sigma2)
    ]
    return result


def _social_findings(rows: list[dict[str, Any]], s: SocialSettings, sigma2: float) -> list[Finding]:
    trees = [r for r in rows if r["algo"] == "relay"]
    d2 = _find(rows, method="D2 full graph [(W+I)/2]")
    dpsgd = _find(rows, method="DP-SGD full graph")
    d2_steps = d2["steps"] if d2["reached"] else None
    dp_steps = dpsgd["steps"] if dpsgd["reached"] else None
    tree_steps = [r["steps"] if r["reached"] else None for r in trees]
    return [
        Finding(
            f"RelaySGD on every spanning tree is as fast as D2 on the full graph (within 25% or 2 steps, sigma2={sigma2:g})",
            d2_steps is not None
            and all(t is not None and t <= max(1.25 * d2_steps, d2_steps + 2) for t in tree_steps),
            f"trees {'/'.join(map(_fmt, tree_steps))} (roots {'/'.join(map(str, s.roots))}), D2 {_fmt(d2_steps)}",
        ),
        Finding(
            f"RelaySGD on spanning trees is significantly faster than DP-SGD on the full graph (>= 1.5x fewer steps, sigma2={sigma2:g})",
            all(t is not None and (dp_steps is None or dp_steps >= 1.5 * t) for t in tree_steps),
            f"trees {'/'.join(map(_fmt, tree_steps))}, DP-SGD {_cell(dpsgd)}",
        ),
    ] + (
        [
            Finding(
                "a spanning tree communicates less per step than the full graph",
                all(r["bytes_per_step_with_counters"] < d2["bytes_per_step"] for r in trees),
                f"tree {trees[0]['bytes_per_step_with_counters']} B/step (with counters) vs full graph {d2['bytes_per_step']} B/step ({trees[0]['edges']} vs {d2['edges']} edges)",
            )
        ]
        if sigma2 == s.sigma2_values[0]
        else []
    )


# ---------------------------------------------------------------------------------------------
# Distributed mean estimation


def effective_delays(topology: Topology, layer: int = 0) -> np.ndarray:
    """e_ij = max(tau_ij - 1, 0): worker j's value of step s reaches worker i in step s + e_ij (Algorithm 1's timing)."""
    return np.maximum(topology.delays(layer) - 1, 0)


def relaysum_dme_estimates(
    samples: np.ndarray, topology: Topology, checkpoints: Sequence[int]
) -> np.ndarray:
    """RelaySum mean estimates (appendix Algorithm "RelaySum for Distributed Mean Estimation"), vectorized.

    samples [R, T, n]: repetition r, step t, worker j. After T steps worker i holds worker j's
    samples of steps 0 .. T-1-e_ij (neighbours' samples arrive in the same step), so its
    estimate is their plain mean: sum_j S_j(T - e_ij) / sum_j max(T - e_ij, 0), with S_j(m)
    the sum of j's first m samples. Returns [R, len(checkpoints), n].
    """
    R, T, n = samples.shape
    if topology.num_layers != 1 or not topology.is_tree or topology.world_size != n:
        raise ValueError(
            f"RelaySum mean estimation needs one spanning tree over {n} workers, got {topology!r}"
        )
    prefix = np.concatenate(
        [np.zeros((R, 1, n)), np.cumsum(samples, axis=1)], axis=1
    )  # [R, T+1, n]
    delay = effective_delays(topology)
    workers = np.arange(n)[None, :]
    out = np.empty((R, len(checkpoints), n))
    for k, steps in enumerate(checkpoints):
        if not 1 <= steps <= T:
            raise ValueError(f"checkpoints must be in [1, {T}], got {steps}")
        held = np.maximum(steps - delay, 0)  # [i, j]: how many of j's samples worker i holds
        out[:, k, :] = prefix[:, held, workers].sum(axis=2) / held.sum(axis=1)
    return out


def gossip_dme_estimates(
    samples: np.ndarray, mixing: np.ndarray, checkpoints: Sequence[int]
) -> np.ndarray:
    """Gossip baseline: y(t+1) = W (y(t) + d(t)) from y(0) = 0; the estimate after T steps is y(T) / T.

    With W = I this is every worker's own running mean, with W = 11^T / n the global one; W is
    doubly stochastic, so y(T) / T is a running mean of samples gossiped over the graph.
    Returns [R, len(checkpoints), n].
    """
    R, T, n = samples.shape
    wanted = {steps: k for k, steps in enumerate(checkpoints)}
    out = np.empty((R, len(checkpoints), n))
    y = np.zeros((R, n))
    for t in range(T):
        y = (y + samples[:, t, :]) @ mixing.T
        if t + 1 in wanted:
            out[:, wanted[t + 1], :] = y / (t + 1)
    return out


def relaysum_dme_expected_mse(topology: Topology, steps: int, variance: float = 1.0) -> float:
    """E (estimate - mean)^2 averaged over workers: worker i's estimate is a mean of N_i(T) samples."""
    held = np.maximum(steps - effective_delays(topology), 0).sum(axis=1)
    return float(np.mean(variance / held))


def gossip_dme_expected_mse(mixing: np.ndarray, steps: int, variance: float = 1.0) -> float:
    """(1 / T^2) sum_{k=1..T} (W^{2k})_ii averaged over workers (W symmetric): the gossip baseline's MSE."""
    eigenvalues, vectors = np.linalg.eigh(mixing)
    squares = eigenvalues**2
    total = np.empty_like(squares)
    near_one = np.isclose(squares, 1.0)
    total[near_one] = steps
    q = squares[~near_one]
    total[~near_one] = q * (1 - q**steps) / (1 - q)  # sum_{k=1..T} q^k
    diagonal = (vectors**2) @ total  # sum_k (W^{2k})_ii
    return float(variance * diagonal.mean() / steps**2)


def study_dme(s: DmeSettings, seed: int) -> StudyResult:
    result = StudyResult("dme", s)
    rng = np.random.default_rng([seed, 0xD3E])
    T = max(s.checkpoints)
    for n in s.n_values:
        chain, ring = build("chain", n), build("ring", n)
        mixing = ring.mixing_matrix(0)
        relay_sq = np.zeros(len(s.checkpoints))
        gossip_sq = np.zeros(len(s.checkpoints))
        for start in range(0, s.repetitions, s.chunk):
            reps = min(s.chunk, s.repetitions - start)
            samples = rng.normal(s.mean, 1.0, size=(reps, T, n))
            relay_sq += (
                ((relaysum_dme_estimates(samples, chain, s.checkpoints) - s.mean) ** 2)
                .mean(axis=2)
                .sum(axis=0)
            )
            gossip_sq += (
                ((gossip_dme_estimates(samples, mixing, s.checkpoints) - s.mean) ** 2)
                .mean(axis=2)
                .sum(axis=0)
            )
        relay_mse, gossip_mse = relay_sq / s.repetitions, gossip_sq / s.repetitions
        e_bar = float(effective_delays(chain).mean())
        for k, steps in enumerate(s.checkpoints):
            ideal = 1.0 / (n * (steps - e_bar)) if steps > e_bar else math.inf
            result.add(
                {
                    "n": n,
                    "T": steps,
                    "relay_mse": float(relay_mse[k]),
                    "relay_expected_mse": relaysum_dme_expected_mse(chain, steps),
                    "ideal_mse": ideal,
                    "gossip_mse": float(gossip_mse[k]),
                    "gossip_expected_mse": gossip_dme_expected_mse(mixing, steps),
                    "mean_delay": e_bar,
                }
            )
        result.data[f"relay_mse_n{n}"] = relay_mse
        result.data[f"gossip_mse_n{n}"] = gossip_mse
    result.data["checkpoints"] = np.asarray(s.checkpoints)
    for n in s.n_values:
        e_bar = _find(result.rows, n=n)["mean_delay"]
        columns = [
            "relay MSE",
            "relay exact",
            "1/(n T_eff)",
            "relay nT*MSE",
            "gossip MSE",
            "gossip exact",
            "gossip nT*MSE",
        ]

        def cell(label: str, column: str, n: int = n) -> str:
            row = _find(result.rows, n=n, T=int(label[2:]))
            scale = n * row["T"]
            return {
                "relay MSE": f"{row['relay_mse']:.3e}",
                "relay exact": f"{row['relay_expected_mse']:.3e}",
                "1/(n T_eff)": f"{row['ideal_mse']:.3e}"
                if math.isfinite(row["ideal_mse"])
                else "-",
                "relay nT*MSE": f"{scale * row['relay_mse']:.3f}",
                "gossip MSE": f"{row['gossip_mse']:.3e}",
                "gossip exact": f"{row['gossip_expected_mse']:.3e}",
                "gossip nT*MSE": f"{scale * row['gossip_mse']:.3f}",
            }[column]

        table = _grid(
            f"n={n}: RelaySum (chain) | gossip (ring, MH)",
            [f"T={t}" for t in s.checkpoints],
            columns,
            cell,
        )
        result.tables.append(
            table
            + f"\n(MSE: measured over {s.repetitions} repetitions, samples ~ N({s.mean:g}, 1); exact: its expectation;"
            f" T_eff = T - {e_bar:.3f}, the mean effective delay on the chain)"
        )
    result.findings = _dme_findings(result.rows, s)
    return result


def _dme_findings(rows: list[dict[str, Any]], s: DmeSettings) -> list[Finding]:
    findings = []
    for n in s.n_values:
        ours = [r for r in rows if r["n"] == n]
        settled = [r for r in ours if r["T"] >= 2 * n]
        ratios = [r["relay_mse"] / r["ideal_mse"] for r in settled]
        if ratios:
            findings.append(
                Finding(
                    f"n={n}: RelaySum MSE ~ 1/(n (T - mean delay)) = O(1/(nT)) (within 20% for T >= 2n)",
                    all(0.8 <= q <= 1.2 for q in ratios),
                    "MSE / ideal "
                    + "/".join(f"{q:.2f}" for q in ratios)
                    + f" at T={'/'.join(str(r['T']) for r in settled)}",
                )
            )
        later = [r for r in ours if r["T"] >= 2]
        findings.append(
            Finding(
                f"n={n}: RelaySum has a lower expected MSE than the gossip baseline at every T >= 2",
                all(r["relay_expected_mse"] < r["gossip_expected_mse"] for r in later),
                "gossip/RelaySum: exact "
                + "/".join(
                    f"{r['gossip_expected_mse'] / r['relay_expected_mse']:.2f}" for r in later
                )
                + ", measured "
                + "/".join(f"{r['gossip_mse'] / r['relay_mse']:.2f}" for r in later)
                + f" at T={'/'.join(str(r['T']) for r in later)}",
            )
        )
        # gossip needs about the mixing time (~n^2 on a ring) to reach O(1/(nT)); RelaySum the diameter
        reach = {}
        for key in ("relay_mse", "gossip_mse"):
            reach[key] = next((r["T"] for r in ours if n * r["T"] * r[key] <= 1.25), None)
        findings.append(
            Finding(
                f"n={n}: RelaySum gets within 25% of 1/(nT) much earlier than gossip (>= 2x fewer steps)",
                reach["relay_mse"] is not None
                and (reach["gossip_mse"] is None or reach["gossip_mse"] >= 2 * reach["relay_mse"]),
                f"first T with n T MSE <= 1.25: RelaySum {reach['relay_mse']}, gossip {reach['gossip_mse']}",
            )
        )
    return findings


# ---------------------------------------------------------------------------------------------
# Learning-rate correction, measured


@dataclass
class LrCorrectionMeasurement:
    factor: float  # 1 / (alpha n), averaged over layers like relaympi.topology.lr_correction
    limits: (
        np.ndarray
    )  # per layer: the value every worker settles on after a +1 update on every worker (= alpha n)
    steps: int  # steps run after the update
    converged: bool


def measure_lr_correction(
    topology: Topology, tolerance: float = 1e-10, max_steps: int = 200_000
) -> LrCorrectionMeasurement:
    """Measure RelaySGD's learning-rate correction on the matrix engine (appendix "Learning-rate correction").

    Every worker holds one coordinate per layer at 0 and runs zero updates until the relay is in
    steady state (after tau_max steps every message has arrived once, so workers divide by n),
    then one update of +1 on every worker, then none. Each new model is a mean of values of the
    last tau_max + 1 steps, so the limit lies between their minimum and maximum: stop once that
    range is narrower than ``tolerance`` (relative) and take its midpoint.
    """
    n, layers = topology.world_size, topology.num_layers
    engine = make_matrix_algorithm("relay", topology, n, np.zeros(layers), OptimizerConfig())
    tau_max = int(max(effective_delays(topology, k).max() for k in range(layers)))
    zero, impulse = np.zeros((n, layers)), -np.ones((n, layers))  # u = -lr g = +1 with lr = 1
    X = np.zeros((n, layers))
    for t in range(tau_max):
        X = engine.step(X, zero, 1.0, t)
    X = engine.step(X, impulse, 1.0, tau_max)
    window = [X]
    low = high = X[0]
    converged = False
    steps = 1
    while steps < max_steps:
        X = engine.step(X, zero, 1.0, tau_max + steps)
        steps += 1
        window.append(X)
        del window[: -(tau_max + 1)]
        stacked = np.stack(window)
        low, high = stacked.min(axis=(0, 1)), stacked.max(axis=(0, 1))
        if steps > tau_max + 1 and np.all(high - low <= tolerance * np.abs(high + low) / 2):
            converged = True
            break
    limits = (low + high) / 2
    return LrCorrectionMeasurement(float(np.mean(1.0 / limits)), limits, steps, converged)


def study_lr_correction(s: LrCorrectionSettings) -> StudyResult:
    result = StudyResult("lr-correction", s)
    for name in s.topologies:
        for n in s.n_values:
            topology = build(name, n)
            start = time.perf_counter()
            measured = measure_lr_correction(topology, s.tolerance)
            computed = lr_correction(topology)
            result.add(
                {
                    "topology": name,
                    "n": n,
                    "measured": measured.factor,
                    "computed": computed,
                    "relative_difference": abs(measured.factor / computed - 1),
                    "steps": measured.steps,
                    "converged": measured.converged,
                    "wall_s": time.perf_counter() - start,
                }
            )
    columns = [f"n={n}" for n in s.n_values]

    def cell(name: str, column: str) -> str:
        row = _find(result.rows, topology=name, n=int(column[2:]))
        return f"{row['measured']:.10f} ({row['steps']} steps)"

    result.tables.append(_grid("measured 1/(alpha n)", list(s.topologies), columns, cell))
    result.tables.append(
        _grid(
            "lr_correction()",
            list(s.topologies),
            columns,
            lambda name, c: f"{_find(result.rows, topology=name, n=int(c[2:]))['computed']:.10f}",
        )
    )
    worst = max(r["relative_difference"] for r in result.rows)
    result.findings = [
        Finding(
            "measured correction factor equals relaympi.topology.lr_correction (rel. 1e-9)",
            worst <= 1e-9 and all(r["converged"] for r in result.rows),
            f"largest relative difference {worst:.1e}",
        ),
    ]
    if "chain" in s.topologies and "binary-tree" in s.topologies and len(s.n_values) >= 2:
        chain = [_find(result.rows, topology="chain", n=n)["measured"] for n in s.n_values]
        tree = [_find(result.rows, topology="binary-tree", n=n)["measured"] for n in s.n_values]
        result.findings.append(
            Finding(
                "the correction grows ~linearly in n on a chain and ~logarithmically on a binary tree",
                chain[-1] / chain[0] > tree[-1] / tree[0],
                f"chain {'/'.join(f'{v:.2f}' for v in chain)}, binary tree {'/'.join(f'{v:.2f}' for v in tree)} for n={'/'.join(map(str, s.n_values))}",
            )
        )
    return result


# ---------------------------------------------------------------------------------------------
# running, writing, printing


def run_study(
    study: str, quick: bool = False, seed: int = 0, max_steps: int | None = None
) -> StudyResult:
    settings = settings_for(study, quick, seed, max_steps)
    start = time.perf_counter()
    if study == "fig2":
        result = study_fig2(settings)
    elif study in ("heterogeneity", "star"):
        result = study_heterogeneity(settings)
    elif study == "social":
        result = study_social(settings)
    elif study == "dme":
        result = study_dme(settings, seed)
    else:
        result = study_lr_correction(settings)
    result.elapsed_s = time.perf_counter() - start
    return result


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def write_result(result: StudyResult, out_dir: Path, provenance: dict[str, Any]) -> Path:
    """Write one study's HDF5 file (layout in the module docstring); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result.study}.h5"
    strings = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        f.attrs["kind"] = "quadratics-study"
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["study"] = result.study
        f.attrs.create(
            "settings",
            json.dumps(dataclasses.asdict(result.settings), sort_keys=True, default=_json_default),
            dtype=strings,
        )
        f.attrs.create(
            "provenance",
            json.dumps(provenance, sort_keys=True, default=_json_default),
            dtype=strings,
        )
        f.attrs.create(
            "findings", json.dumps([dataclasses.asdict(x) for x in result.findings]), dtype=strings
        )
        f.attrs["elapsed_s"] = result.elapsed_s
        table = f.create_group("table")
        for column in result.rows[0] if result.rows else ():
            values = [row.get(column) for row in result.rows]
            if all(isinstance(v, str) for v in values):
                table.create_dataset(column, data=np.array(values, dtype=object), dtype=strings)
            else:
                table.create_dataset(column, data=np.array(values))
        curves, trials = f.create_group("curves"), f.create_group("trials")
        for index, (curve, tried) in enumerate(zip(result.curves, result.trials, strict=True)):
            if curve is not None:
                curves.create_dataset(str(index), data=curve, compression="gzip")
            if tried is not None:
                dataset = trials.create_dataset(str(index), data=tried)
                dataset.attrs["columns"] = (
                    "lr, steps to target (-1: not reached), lowest suboptimality"
                )
        data = f.create_group("data")
        for name, values in result.data.items():
            data.create_dataset(name, data=values)
    return path


def report(result: StudyResult) -> str:
    """The printed form of a study: its tables, the paper's findings, and its wall time."""
    lines = [f"== {result.study} ({result.elapsed_s:.1f} s) =="]
    for table in result.tables:
        lines += [table, ""]
    lines.append("paper findings:")
    lines += [f"  - {finding.line()}" for finding in result.findings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quadratics", description=__doc__.splitlines()[0]
    )
    parser.add_argument("study", choices=(*STUDIES, "all"))
    parser.add_argument(
        "--quick", action="store_true", help="reduced settings (smoke test, < 1 minute for all)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for the HDF5 files (default {DEFAULT_OUT})",
    )
    parser.add_argument("--seed", type=int, default=0, help="problem and noise seed")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="cap on gradient steps per run (default 20000; quick 2000)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every tuned run")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )

    from threadpoolctl import threadpool_limits

    from relaympi.provenance import collect

    provenance = collect({"backend": "matrix"})
    studies = STUDIES if args.study == "all" else (args.study,)
    # The engine's matrices are small: BLAS threads only contend (up to 100x slower on 2 cores).
    with threadpool_limits(1, user_api="blas"):
        for study in studies:
            result = run_study(study, quick=args.quick, seed=args.seed, max_steps=args.max_steps)
            path = write_result(result, args.out, provenance)
            print(report(result))
            print(f"wrote {path}\n", flush=True)
    return 0


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)

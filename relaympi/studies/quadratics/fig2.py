"""Figure 2: tuned steps to a target suboptimality as the number of workers grows (ring, trees,
exponential), over several problem seeds, and the figure drawn as the paper draws it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.studies.quadratics.findings import Finding, StudyResult
from relaympi.studies.quadratics.tables import (
    Row,
    fmt,
    grid,
    log_log_slope,
    median_steps,
    ratio_within,
    seed_steps,
)
from relaympi.studies.quadratics.tuned import (
    EXACT_DIFFUSION_MARK,
    ProblemSettings,
    add_tuned,
    make_problem,
)
from relaympi.studies.quadratics.tuning import Method, SearchConfig, d2_method
from relaympi.topology import build


@dataclass(frozen=True)
class Fig2Settings:
    """Figure 2: sigma^2 = 0, r0 = 10, L = 1, mu = 0.5 (its caption); d = 10, the two panels'
    zeta^2 = 0.01 and 1 and the step cap 20,000 as in the authors' code (the paper states none of
    them); zeta^2 = 0 as well, where no communication is needed (a check, not drawn)."""

    problem: ProblemSettings = ProblemSettings()
    # powers of two: SGP's exponential schedule needs them
    n_values: tuple[int, ...] = (4, 8, 16, 32, 64)
    zeta2_values: tuple[float, ...] = (0.0, 0.01, 1.0)
    seeds: tuple[int, ...] = tuple(range(10))  # problem seeds; every cell is tuned per seed
    search: SearchConfig = SearchConfig(target=1e-6)  # target, learning-rate search, step cap


def _methods(n: int) -> list[Method]:
    ring, tree = build("ring", n), build("binary-tree", n)
    return [
        Method("RelaySGD chain", "relay", build("chain", n)),
        Method("RelaySGD binary-tree", "relay", tree),
        Method("RelaySGD double-binary-trees", "relay", build("double-binary-trees", n)),
        d2_method("D2 ring", ring),
        d2_method("D2 binary-tree", tree),
        Method("GT ring", "gt", ring),
        Method("GT binary-tree", "gt", tree),
        Method("SGP exponential", "sgp", build("exponential", n)),
        Method("all-reduce (reference)", "allreduce", build("fully-connected", n)),
    ]


# The figure's series: (method, colour, line style) as the paper's caption gives them: RelaySGD
# red, D2 cyan, GT blue, SGP orange (tab10); rings (and RelaySGD's chain) dashed, binary trees
# solid, SGP's time-varying exponential graph dotted.
FIGURE_SERIES = (
    ("RelaySGD chain", "tab:red", "--"),
    ("RelaySGD binary-tree", "tab:red", "-"),
    ("D2 ring", "tab:cyan", "--"),
    ("D2 binary-tree", "tab:cyan", "-"),
    ("GT ring", "tab:blue", "--"),
    ("GT binary-tree", "tab:blue", "-"),
    ("SGP exponential", "tab:orange", ":"),
)


def study_fig2(s: Fig2Settings) -> StudyResult:
    result = StudyResult("fig2", s)
    for seed in s.seeds:
        for zeta2 in s.zeta2_values:
            for n in s.n_values:
                problem = make_problem(n, s.problem, zeta2, 0.0, seed)
                for method in _methods(n):
                    context = f"fig2 seed={seed} zeta2={zeta2:g} n={n:d}"
                    add_tuned(
                        result,
                        problem,
                        method,
                        s.search,
                        context,
                        seed=seed,
                        n=n,
                        zeta2=zeta2,
                        sigma2=0.0,
                    )
    labels = [m.label for m in _methods(4)]
    for zeta2 in s.zeta2_values:
        result.tables += _seed_tables(result.rows, s, labels, zeta2)
    result.tables.append(
        f"median [min-max] over {len(s.seeds)} seed(s) {_seed_text(s.seeds)}; "
        f"{EXACT_DIFFUSION_MARK}: D2 with (W+I)/2 (MH matrix has smallest eigenvalue < -1/3); "
        f"n.r.: not reached within {s.search.max_steps} steps (a median of n.r.: more than half "
        "of the seeds did not reach it)"
    )
    result.findings = _findings(result.rows, s)
    return result


def _seed_text(seeds: tuple[int, ...]) -> str:
    if len(seeds) > 2 and seeds == tuple(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def steps_cell(rows: list[Row], **match: Any) -> str:
    """One cell of the steps table: the median over seeds and its [min-max] (n.r. for a seed that
    did not reach the target), marked for D2 with (W + I) / 2.

    Args:
        rows: the study's rows.
        **match: the cell's columns (method, zeta2, n).

    Returns:
        The cell's text; "-" where no row matches.
    """
    values = seed_steps(rows, **match)
    if not values:
        return "-"
    mark = (
        EXACT_DIFFUSION_MARK
        if any(
            r.get("d2_exact_diffusion")
            for r in rows
            if all(r.get(k) == v for k, v in match.items())
        )
        else ""
    )
    median = float(np.median(values))

    def text(v: float) -> str:
        return f"{v:g}" if math.isfinite(v) else "n.r."

    if len(values) == 1:
        return text(values[0]) + mark
    return f"{text(median)} [{text(min(values))}-{text(max(values))}]{mark}"


def _seed_tables(rows: list[Row], s: Fig2Settings, labels: list[str], zeta2: float) -> list[str]:
    columns = [f"n={n}" for n in s.n_values]

    def lr_cell(label: str, column: str) -> str:
        lrs = [
            r["lr"]
            for r in rows
            if r["method"] == label and r["zeta2"] == zeta2 and r["n"] == int(column[2:])
        ]
        return f"{float(np.median(lrs)):.3g}" if lrs else "-"

    return [
        grid(
            f"steps to {s.search.target:g}, zeta2={zeta2:g}",
            labels,
            columns,
            lambda label, c: steps_cell(rows, method=label, zeta2=zeta2, n=int(c[2:])),
        ),
        grid(f"tuned lr (median), zeta2={zeta2:g}", labels, columns, lr_cell),
    ]


def fig2_figure(result: StudyResult) -> Any:
    """Figure 2 as the paper draws it: steps to the target against n on log-log axes, one panel
    per heterogeneous zeta^2; the line is the median over seeds, the band its min-max (a seed that
    did not reach the target leaves its cell's band open up to the step cap; a median of n.r. is
    not drawn).

    Args:
        result: the fig2 study's result (its rows and settings).

    Returns:
        The matplotlib Figure (Agg).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s: Fig2Settings = result.settings
    panels = [z for z in s.zeta2_values if z > 0] or list(s.zeta2_values)
    ns = np.asarray(s.n_values, dtype=float)
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.6 * len(panels), 4.4), sharey=True, squeeze=False
    )
    for ax, zeta2 in zip(axes[0], panels, strict=True):
        for label, colour, style in FIGURE_SERIES:
            per_n = [seed_steps(result.rows, method=label, zeta2=zeta2, n=n) for n in s.n_values]
            median = np.array([np.median(v) if v else math.nan for v in per_n])
            low = np.array([min(v) if v else math.nan for v in per_n])
            high = np.array([max(v) if v else math.nan for v in per_n])
            median[~np.isfinite(median)] = math.nan
            ax.plot(
                ns, median, color=colour, linestyle=style, marker="o", markersize=3, label=label
            )
            if len(s.seeds) > 1:
                shown = np.isfinite(low)
                ax.fill_between(
                    ns[shown],
                    low[shown],
                    np.where(np.isfinite(high), high, s.search.max_steps)[shown],
                    color=colour,
                    alpha=0.12,
                    linewidth=0,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in s.n_values])
        ax.set_title(f"$\\zeta^2$ = {zeta2:g}")
        ax.set_xlabel("number of workers n")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"steps to $f(\\bar{{x}}) - f(x^\\star) \\leq$ {s.search.target:g}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # under the panels, so that no line hides behind it
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, handlelength=3)
    figure.suptitle(
        f"random quadratics, d={s.problem.dim}, mu={s.problem.mu:g}, L={s.problem.L:g}, "
        f"r0={s.problem.r0:g}, sigma2=0; median and min-max over {len(s.seeds)} seed(s)",
        fontsize=9,
    )
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    return figure


def draw_fig2(result: StudyResult, out_dir: Path) -> Path:
    """Write fig2_figure's figure to ``out_dir``/fig2.png.

    Args:
        result: the fig2 study's result.
        out_dir: the study's output directory (--out).

    Returns:
        The PNG's path.
    """
    import matplotlib.pyplot as plt

    figure = fig2_figure(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fig2.png"
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path


def _findings(rows: list[Row], s: Fig2Settings) -> list[Finding]:
    """The caption's and the text's claims, judged on the median over seeds of every cell."""
    ns = list(s.n_values)
    hetero = [z for z in s.zeta2_values if z > 0]
    z_max = max(s.zeta2_values)

    def steps_of(**match: Any) -> float | None:
        return median_steps(rows, **match)

    def series(label: str, zeta2: float) -> list[float | None]:
        return [steps_of(method=label, zeta2=zeta2, n=n) for n in ns]

    def show(label: str, zeta2: float) -> str:
        return "/".join(fmt(v) for v in series(label, zeta2))

    def slope(exponent: float | None) -> str:
        return str(exponent if exponent is None else round(exponent, 2))

    findings = []
    large = [n for n in ns if n >= 16] or ns
    # log2 n itself has a log-log slope of about 0.4 over n = 4..64 (not 0): growth "~log n" is a
    # slope at most that of log2 n over the same n (a tenth of margin for the medians' noise)
    log_n_slope = log_log_slope(ns, [math.log2(n) for n in ns])
    for label in ("RelaySGD binary-tree", "RelaySGD double-binary-trees"):
        exponent = log_log_slope(ns, series(label, z_max))
        findings.append(
            Finding(
                f"{label}: steps grow ~log n (zeta2={z_max:g})",
                exponent is not None and log_n_slope is not None and exponent <= log_n_slope + 0.1,
                f"median steps {show(label, z_max)} for n={'/'.join(map(str, ns))}; log-log "
                f"slope {slope(exponent)}, log2 n has {slope(log_n_slope)}, linear growth 1",
            )
        )
    for label in ("RelaySGD chain", "D2 ring"):
        steps = [steps_of(method=label, zeta2=z_max, n=n) for n in large]
        exponent = log_log_slope(large, steps)
        findings.append(
            Finding(
                f"{label}: steps grow ~linearly (or faster) in n on heterogeneous data "
                f"(zeta2={z_max:g})",
                exponent is not None and exponent >= 0.7,
                f"median steps {'/'.join(map(fmt, steps))} for n={'/'.join(map(str, large))}; "
                f"log-log slope {slope(exponent)}",
            )
        )
        if len(hetero) >= 2:
            ok = True
            worst = 1.0
            for n in ns:
                within, ratio = ratio_within(
                    [steps_of(method=label, zeta2=z, n=n) for z in hetero], 0.15
                )
                ok &= within
                worst = max(worst, ratio or math.inf)
            findings.append(
                Finding(
                    f"{label}: steps independent of heterogeneity (zeta2 in "
                    f"{'/'.join(f'{z:g}' for z in hetero)}, medians within 15%)",
                    ok,
                    "; ".join(
                        f"n={n}: "
                        + "/".join(fmt(steps_of(method=label, zeta2=z, n=n)) for z in hetero)
                        for n in ns
                    )
                    + f"; worst ratio {worst:.2f}",
                )
            )
    if 0.0 in s.zeta2_values and hetero:
        # zeta2 = 0 makes x* every worker's own optimum: no communication needed, so no growth
        # with n
        homogeneous = series("RelaySGD chain", 0.0)
        heterogeneous = series("RelaySGD chain", max(hetero))
        findings.append(
            Finding(
                "RelaySGD chain: zeta2=0 (no communication needed) takes no more steps "
                f"than zeta2={max(hetero):g}",
                all(
                    a is not None and (b is None or a <= b)
                    for a, b in zip(homogeneous, heterogeneous, strict=True)
                ),
                f"{show('RelaySGD chain', 0.0)} vs {show('RelaySGD chain', max(hetero))} "
                f"for n={'/'.join(map(str, ns))}",
            )
        )
    n_max = ns[-1]
    for base in ("D2", "GT"):
        ring = steps_of(method=f"{base} ring", zeta2=z_max, n=n_max)
        tree = steps_of(method=f"{base} binary-tree", zeta2=z_max, n=n_max)
        findings.append(
            Finding(
                f"{base}: a binary tree does not help it much compared with a ring "
                f"(n={n_max}, zeta2={z_max:g})",
                ring is not None and (tree is None or tree >= 0.5 * ring),
                f"median ring {fmt(ring)}, binary tree {fmt(tree)} steps",
            )
        )
    relay, d2, gt = (
        steps_of(method=m, zeta2=z_max, n=n_max) for m in ("RelaySGD chain", "D2 ring", "GT ring")
    )
    findings.append(
        Finding(
            "RelaySGD (chain) and D2 (ring) scale significantly better than GT (ring) "
            f"(n={n_max}, zeta2={z_max:g}, >= 2x fewer steps)",
            relay is not None and d2 is not None and (gt is None or gt >= 2 * max(relay, d2)),
            f"median RelaySGD {fmt(relay)}, D2 {fmt(d2)}, GT {fmt(gt)} steps",
        )
    )
    tree_relay = steps_of(method="RelaySGD binary-tree", zeta2=z_max, n=n_max)
    tree_d2 = steps_of(method="D2 binary-tree", zeta2=z_max, n=n_max)
    findings.append(
        Finding(
            f"RelaySGD beats D2 on binary trees (n={n_max}, zeta2={z_max:g})",
            tree_relay is not None and (tree_d2 is None or tree_relay < tree_d2),
            f"median RelaySGD {fmt(tree_relay)}, D2 {fmt(tree_d2)} steps",
        )
    )
    # With n <= 4 the schedule's log2(n) <= 2 rounds per step average exactly: SGP is
    # all-reduce there.
    gossiping = [n for n in ns if n > 4]
    if len(gossiping) >= 2:
        sgp = [steps_of(method="SGP exponential", zeta2=z_max, n=n) for n in gossiping]
        exponent = log_log_slope(gossiping, sgp)
        reached = [v for v in sgp if v is not None]  # all of sgp where exponent is not None
        findings.append(
            Finding(
                "SGP (exponential): steps do not consistently grow with n "
                f"(zeta2={z_max:g}, n > 4)",
                exponent is not None
                and (
                    exponent < 0.3 or any(b < a for a, b in zip(reached, reached[1:], strict=False))
                ),
                f"median steps {'/'.join(map(fmt, sgp))} for n={'/'.join(map(str, gossiping))}; "
                f"log-log slope {slope(exponent)}",
            )
        )
    z_min = min(hetero) if len(hetero) >= 2 else min(s.zeta2_values)
    if z_min < z_max and gossiping:
        pairs = [
            (
                steps_of(method="SGP exponential", zeta2=z_min, n=n),
                steps_of(method="SGP exponential", zeta2=z_max, n=n),
            )
            for n in gossiping
        ]
        findings.append(
            Finding(
                f"SGP needs more steps with more heterogeneity (zeta2={z_min:g} vs "
                f"{z_max:g}, every n > 4)",
                all(a is not None and (b is None or b > a) for a, b in pairs),
                "; ".join(
                    f"n={n}: {fmt(a)} vs {fmt(b)}"
                    for n, (a, b) in zip(gossiping, pairs, strict=True)
                ),
            )
        )
    return findings

"""Figure 2: tuned steps to a target suboptimality as the number of workers grows (ring, trees,
exponential)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relaympi.studies.quadratics.findings import Finding, StudyResult
from relaympi.studies.quadratics.tables import fmt, log_log_slope, ratio_within, steps_of
from relaympi.studies.quadratics.tuned import (
    EXACT_DIFFUSION_MARK,
    ProblemSettings,
    add_tuned,
    make_problem,
    tuned_tables,
)
from relaympi.studies.quadratics.tuning import Method, SearchConfig, d2_method
from relaympi.topology import build


@dataclass(frozen=True)
class Fig2Settings:
    problem: ProblemSettings = ProblemSettings()
    n_values: tuple[int, ...] = (4, 8, 16, 32, 64)
    # The figure's two panels differ in heterogeneity; the text gives no values. zeta2 = 0 makes
    # every worker's own optimum x*, so no communication is needed at all; 1 and 10 are
    # heterogeneous panels.
    zeta2_values: tuple[float, ...] = (0.0, 1.0, 10.0)
    # target suboptimality, learning-rate search, step cap
    search: SearchConfig = SearchConfig(target=1e-6)


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
        Method("DP-SGD ring", "dpsgd", ring),
        Method("DP-SGD binary-tree", "dpsgd", tree),
        Method("SGP exponential", "sgp", build("exponential", n)),
        Method("all-reduce (reference)", "allreduce", build("fully-connected", n)),
    ]


def study_fig2(s: Fig2Settings) -> StudyResult:
    result = StudyResult("fig2", s)
    for zeta2 in s.zeta2_values:
        for n in s.n_values:
            problem = make_problem(n, s.problem, zeta2, 0.0, s.search.seed)
            for method in _methods(n):
                context = f"fig2 zeta2={zeta2:g} n={n:d}"
                add_tuned(result, problem, method, s.search, context, n=n, zeta2=zeta2, sigma2=0.0)
    labels = [m.label for m in _methods(4)]
    columns = {f"n={n}": {"n": n} for n in s.n_values}
    for zeta2 in s.zeta2_values:
        titles = (f"steps to {s.search.target:g}, zeta2={zeta2:g}", f"tuned lr, zeta2={zeta2:g}")
        result.tables += tuned_tables(result.rows, titles, labels, columns, zeta2=zeta2)
    result.tables.append(
        f"{EXACT_DIFFUSION_MARK}: D2 with (W+I)/2 (MH matrix has smallest eigenvalue < "
        f"-1/3); n.r.: not reached within {s.search.max_steps} steps, lowest suboptimality shown"
    )
    result.findings = _findings(result.rows, s)
    return result


def _findings(rows: list[dict[str, Any]], s: Fig2Settings) -> list[Finding]:
    ns = list(s.n_values)
    hetero = [z for z in s.zeta2_values if z > 0]
    z_max = max(s.zeta2_values)

    def series(label: str, zeta2: float) -> list[int | None]:
        return [steps_of(rows, method=label, zeta2=zeta2, n=n) for n in ns]

    def show(label: str, zeta2: float) -> str:
        return "/".join(fmt(v) for v in series(label, zeta2))

    findings = []
    large = [n for n in ns if n >= 16] or ns
    for label in ("RelaySGD binary-tree", "RelaySGD double-binary-trees"):
        exponent = log_log_slope(ns, series(label, z_max))
        findings.append(
            Finding(
                f"{label}: steps grow ~log n (zeta2={z_max:g})",
                exponent is not None and exponent < 0.35,
                f"steps {show(label, z_max)} for n={'/'.join(map(str, ns))}; log-log "
                f"slope {exponent if exponent is None else round(exponent, 2)}, linear "
                "growth has 1",
            )
        )
    for label in ("RelaySGD chain", "D2 ring"):
        steps = [steps_of(rows, method=label, zeta2=z_max, n=n) for n in large]
        exponent = log_log_slope(large, steps)
        findings.append(
            Finding(
                f"{label}: steps grow ~linearly (or faster) in n on heterogeneous data "
                f"(zeta2={z_max:g})",
                exponent is not None and exponent >= 0.7,
                f"steps {'/'.join(map(fmt, steps))} for n={'/'.join(map(str, large))}; "
                f"log-log slope {exponent if exponent is None else round(exponent, 2)}",
            )
        )
        if len(hetero) >= 2:
            ok = True
            worst = 1.0
            for n in ns:
                within, ratio = ratio_within(
                    [steps_of(rows, method=label, zeta2=z, n=n) for z in hetero], 0.15
                )
                ok &= within
                worst = max(worst, ratio or math.inf)
            findings.append(
                Finding(
                    f"{label}: steps independent of heterogeneity (zeta2 in "
                    f"{'/'.join(f'{z:g}' for z in hetero)}, within 15%)",
                    ok,
                    "; ".join(
                        f"n={n}: "
                        + "/".join(fmt(steps_of(rows, method=label, zeta2=z, n=n)) for z in hetero)
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
        ring, tree = (
            steps_of(rows, method=f"{base} ring", zeta2=z_max, n=n_max),
            steps_of(rows, method=f"{base} binary-tree", zeta2=z_max, n=n_max),
        )
        findings.append(
            Finding(
                f"{base}: a binary tree does not help it much compared with a ring "
                f"(n={n_max}, zeta2={z_max:g})",
                ring is not None and (tree is None or tree >= 0.5 * ring),
                f"ring {fmt(ring)}, binary tree {fmt(tree)} steps",
            )
        )
    relay, d2, gt = (
        steps_of(rows, method=m, zeta2=z_max, n=n_max)
        for m in ("RelaySGD chain", "D2 ring", "GT ring")
    )
    findings.append(
        Finding(
            "RelaySGD (chain) and D2 (ring) scale significantly better than GT (ring) "
            f"(n={n_max}, zeta2={z_max:g}, >= 2x fewer steps)",
            relay is not None and d2 is not None and (gt is None or gt >= 2 * max(relay, d2)),
            f"RelaySGD {fmt(relay)}, D2 {fmt(d2)}, GT {fmt(gt)} steps",
        )
    )
    tree_relay, tree_d2 = (
        steps_of(rows, method="RelaySGD binary-tree", zeta2=z_max, n=n_max),
        steps_of(rows, method="D2 binary-tree", zeta2=z_max, n=n_max),
    )
    findings.append(
        Finding(
            f"RelaySGD beats D2 on binary trees (n={n_max}, zeta2={z_max:g})",
            tree_relay is not None and (tree_d2 is None or tree_relay < tree_d2),
            f"RelaySGD {fmt(tree_relay)}, D2 {fmt(tree_d2)} steps",
        )
    )
    # With n <= 4 the schedule's log2(n) <= 2 rounds per step average exactly: SGP is
    # all-reduce there.
    gossiping = [n for n in ns if n > 4]
    if len(gossiping) >= 2:
        sgp = [steps_of(rows, method="SGP exponential", zeta2=z_max, n=n) for n in gossiping]
        exponent = log_log_slope(gossiping, sgp)
        reached = [s for s in sgp if s is not None]  # all of sgp where exponent is not None
        findings.append(
            Finding(
                "SGP (exponential): steps do not consistently grow with n "
                f"(zeta2={z_max:g}, n > 4)",
                exponent is not None
                and (
                    exponent < 0.3 or any(b < a for a, b in zip(reached, reached[1:], strict=False))
                ),
                f"steps {'/'.join(map(fmt, sgp))} for n={'/'.join(map(str, gossiping))}; "
                f"log-log slope {exponent if exponent is None else round(exponent, 2)}",
            )
        )
    z_min = min(s.zeta2_values)
    if z_min < z_max and gossiping:
        pairs = [
            (
                steps_of(rows, method="SGP exponential", zeta2=z_min, n=n),
                steps_of(rows, method="SGP exponential", zeta2=z_max, n=n),
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

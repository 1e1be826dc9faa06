"""Appendix "Independence of heterogeneity" (n = 32 ring, RelaySGD on a chain) and "Star
topology"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relaympi.studies.quadratics.findings import Finding, StudyResult
from relaympi.studies.quadratics.tables import fmt, ratio_within, steps_of
from relaympi.studies.quadratics.tuned import ProblemSettings, add_tuned, make_problem, tuned_tables
from relaympi.studies.quadratics.tuning import Method, SearchConfig, d2_method
from relaympi.topology import build


@dataclass(frozen=True)
class HeterogeneitySettings:
    """Appendix "Independence of heterogeneity" (ring, chain for RelaySGD) and "Star topology"."""

    topology: str = "ring"  # "ring" (RelaySGD on a chain) or "star"
    # The captions give n = 32 and the target 1e-6 only; d = 10, r0 = 1, the zeta^2 values, the
    # ring's gradient noise (E||xi||^2 = 0.05^2) and the cap of 10,000 steps are the authors'
    # code's. STAR below holds the star's values.
    problem: ProblemSettings = ProblemSettings(r0=1.0)
    n: int = 32
    zeta2_values: tuple[float, ...] = (0.0, 0.1, 10.0)
    sigma2_values: tuple[float, ...] = (0.0, 0.0025)  # noise-free, and the figure's noise
    search: SearchConfig = SearchConfig(target=1e-6, noise_seeds=4, max_steps=10_000)


# The star's appendix figure: no gradient noise, zeta^2 in 0, 0.01 and 0.1 (the authors' code).
STAR = HeterogeneitySettings(topology="star", zeta2_values=(0.0, 0.01, 0.1), sigma2_values=(0.0,))


def _methods(topology: str, n: int) -> list[Method]:
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
    methods = _methods(s.topology, s.n)
    for sigma2 in s.sigma2_values:
        for zeta2 in s.zeta2_values:
            problem = make_problem(s.n, s.problem, zeta2, sigma2, s.search.seed)
            for method in methods:
                context = f"{name} sigma2={sigma2:g} zeta2={zeta2:g}"
                add_tuned(
                    result, problem, method, s.search, context, n=s.n, zeta2=zeta2, sigma2=sigma2
                )
    labels = [m.label for m in methods]
    columns = {f"zeta2={z:g}": {"zeta2": z} for z in s.zeta2_values}
    for sigma2 in s.sigma2_values:
        noise = f"sigma2={sigma2:g}" + (
            f" ({s.search.noise_seeds} noise streams)" if sigma2 > 0 else ""
        )
        titles = (
            f"n={s.n} {s.topology}, steps to {s.search.target:g}, {noise}",
            f"tuned lr, {noise}",
        )
        result.tables += tuned_tables(result.rows, titles, labels, columns, sigma2=sigma2)
    result.tables.append(
        f"n.r.: not reached within {s.search.max_steps} steps, lowest suboptimality shown"
    )
    result.findings = _findings(result.rows, s, labels)
    return result


def _findings(
    rows: list[dict[str, Any]], s: HeterogeneitySettings, labels: list[str]
) -> list[Finding]:
    relay, d2, dpsgd = labels[0], labels[1], labels[3]
    findings = []
    z_min, z_max = min(s.zeta2_values), max(s.zeta2_values)
    for sigma2 in s.sigma2_values:
        variant = f"sigma2={sigma2:g}"

        def steps(label: str, zeta2: float, v: float = sigma2) -> int | None:
            return steps_of(rows, method=label, sigma2=v, zeta2=zeta2)

        # zeta2 = 0 makes x* every worker's own optimum (no communication needed): also compare
        # zeta2 > 0 alone
        groups = [s.zeta2_values]
        positive = tuple(z for z in s.zeta2_values if z > 0)
        if len(positive) >= 2 and len(positive) < len(s.zeta2_values):
            groups.append(positive)
        for label in (relay, d2):
            for group in groups:
                values = [steps(label, z) for z in group]
                ok, ratio = ratio_within(values, 0.10)
                findings.append(
                    Finding(
                        f"{label}: same steps for every zeta2 in "
                        f"{'/'.join(f'{z:g}' for z in group)} (within 10%, {variant})",
                        ok,
                        "/".join(map(fmt, values))
                        + ("" if ratio is None else f"; max/min {ratio:.2f}"),
                    )
                )
        low, high = steps(dpsgd, z_min), steps(dpsgd, z_max)
        findings.append(
            Finding(
                f"{dpsgd}: markedly more steps at zeta2={z_max:g} than at {z_min:g} (>= "
                f"2x or not reached, {variant})",
                low is not None and (high is None or high >= 2 * low),
                f"{fmt(low)} vs {fmt(high)}",
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
                        f"zeta2={z:g}: {fmt(a)} vs {fmt(b)}"
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
                        f"zeta2={z:g}: {fmt(a)} vs {fmt(b)}"
                        for z, (a, b) in zip(s.zeta2_values, pairs, strict=True)
                    ),
                )
            )
    return findings

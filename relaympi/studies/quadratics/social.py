"""Figure 3: RelaySGD on spanning trees of the Davis Southern Women graph vs D² / DP-SGD on the
graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relaympi.algorithms.registry import communication
from relaympi.studies.quadratics.findings import Finding, StudyResult
from relaympi.studies.quadratics.tables import expect_row, fmt, grid
from relaympi.studies.quadratics.tuned import ProblemSettings, add_tuned, make_problem, steps_cell
from relaympi.studies.quadratics.tuning import Method, SearchConfig
from relaympi.topology import build, spanning_tree


@dataclass(frozen=True)
class SocialSettings:
    """Figure 3: RelaySGD on spanning trees of the Davis Southern Women graph vs D² / DP-SGD on the
    graph."""

    problem: ProblemSettings = ProblemSettings(r0=1.0)
    zeta2: float = 0.1
    # the paper's noise level, and a noise-free variant (at sigma2 = 0.1 the noise sets every
    # method's lr)
    sigma2_values: tuple[float, ...] = (0.1, 0.0)
    roots: tuple[int, ...] = (0, 7, 14, 21, 28)  # Spanning Tree Protocol roots: one tree each
    search: SearchConfig = SearchConfig(target=1e-5, noise_seeds=8)


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
        problem = make_problem(32, s.problem, s.zeta2, sigma2, s.search.seed)
        for method, root in methods:
            edges = len(method.topology.edges(0))
            # bytes over the graph's edges, for an algorithm that sends its messages over them
            payload = _bytes_per_step(edges, d) if communication(method.algo).placed else -1
            # RelaySGD's messages carry a float64 counter
            counters = edges * 2 * 8 if method.algo == "relay" else 0
            row = add_tuned(
                result,
                problem,
                method,
                s.search,
                f"social sigma2={sigma2:g}",
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
    columns = ["diameter", "edges", "steps", "lr", "bytes/step", "+counters"]
    for sigma2 in s.sigma2_values:

        def cell(label: str, column: str, v: float = sigma2) -> str:
            row = expect_row(result.rows, method=label, sigma2=v)
            return {
                "diameter": str(row["diameter"]),
                "edges": str(row["edges"]),
                "steps": steps_cell(row),
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
            grid(
                f"social network (32 nodes), zeta2={s.zeta2:g}, {noise}, steps to "
                f"{s.search.target:g}",
                [m.label for m, _ in methods],
                columns,
                cell,
            )
        )
    result.tables.append(
        f"bytes/step = edges x 2 directions x d={d} x 8 bytes (float64 models); +counters "
        "adds RelaySGD's 8-byte counter per message"
    )
    result.findings = [
        f
        for sigma2 in s.sigma2_values
        for f in _findings([r for r in result.rows if r["sigma2"] == sigma2], s, sigma2)
    ]
    return result


def _findings(rows: list[dict[str, Any]], s: SocialSettings, sigma2: float) -> list[Finding]:
    trees = [r for r in rows if r["algo"] == "relay"]
    d2 = expect_row(rows, method="D2 full graph [(W+I)/2]")
    dpsgd = expect_row(rows, method="DP-SGD full graph")
    d2_steps = d2["steps"] if d2["reached"] else None
    dp_steps = dpsgd["steps"] if dpsgd["reached"] else None
    tree_steps = [r["steps"] if r["reached"] else None for r in trees]
    return [
        Finding(
            "RelaySGD on every spanning tree is as fast as D2 on the full graph (within "
            f"25% or 2 steps, sigma2={sigma2:g})",
            d2_steps is not None
            and all(t is not None and t <= max(1.25 * d2_steps, d2_steps + 2) for t in tree_steps),
            f"trees {'/'.join(map(fmt, tree_steps))} (roots "
            f"{'/'.join(map(str, s.roots))}), D2 {fmt(d2_steps)}",
        ),
        Finding(
            "RelaySGD on spanning trees is significantly faster than DP-SGD on the full "
            f"graph (>= 1.5x fewer steps, sigma2={sigma2:g})",
            all(t is not None and (dp_steps is None or dp_steps >= 1.5 * t) for t in tree_steps),
            f"trees {'/'.join(map(fmt, tree_steps))}, DP-SGD {steps_cell(dpsgd)}",
        ),
    ] + (
        [
            Finding(
                "a spanning tree communicates less per step than the full graph",
                all(r["bytes_per_step_with_counters"] < d2["bytes_per_step"] for r in trees),
                f"tree {trees[0]['bytes_per_step_with_counters']} B/step (with counters) "
                f"vs full graph {d2['bytes_per_step']} B/step ({trees[0]['edges']} vs "
                f"{d2['edges']} edges)",
            )
        ]
        if sigma2 == s.sigma2_values[0]
        else []
    )

"""PNG plots for the report: accuracy over epochs, accuracy vs alpha, scaling and quadratics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.report_summary import Curve
from benchmarks.report_tables import Table


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean_curve(curves: Sequence[Curve]) -> Curve:
    """Average over seeds when they share an evaluation grid, else take the longest seed."""
    longest = max(curves, key=lambda c: len(c.epoch))
    same = [
        c
        for c in curves
        if len(c.epoch) == len(longest.epoch) and np.allclose(c.epoch, longest.epoch)
    ]
    if len(same) < 2:
        return longest
    return Curve(
        longest.epoch,
        *(np.mean([getattr(c, k) for c in same], axis=0) for k in ("worst", "mean", "best")),
    )


def plot_curves(table: Table, out_dir: Path) -> list[Path]:
    """Per alpha: mean worker test accuracy over epochs, band from worst to best worker."""
    plt = _pyplot()
    paths = []
    for alpha, by_label in table.curves.items():
        by_label = {label: curves for label, curves in by_label.items() if curves}
        if not by_label:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, curves in by_label.items():
            curve = _mean_curve(curves)
            (line,) = ax.plot(curve.epoch, 100 * curve.mean, label=label)
            ax.fill_between(
                curve.epoch, 100 * curve.worst, 100 * curve.best, color=line.get_color(), alpha=0.2
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(
            f"{table.title}, alpha={alpha:g}" if alpha is not None else table.title, fontsize=9
        )
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = (
            out_dir / f"curves_{table.name}_alpha{alpha:g}.png"
            if alpha is not None
            else out_dir / f"curves_{table.name}.png"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_series(
    table: Table,
    out_dir: Path,
    xlabel: str,
    ylabel: str,
    *,
    logx: bool,
    logy: bool = False,
    percent: bool = True,
) -> Path | None:
    """One line per table row (algorithm, settings and topology) over the columns, min-max error bars."""
    series = {label: points for label, points in table.series.items() if points}
    if len({x for points in series.values() for x in points}) < 2:
        return None
    plt = _pyplot()
    scale = 100 if percent else 1
    xs_all = sorted({x for points in series.values() for x in points})
    place = _x_positions(xs_all, logx)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, points in series.items():
        xs = sorted(points)
        mean, low, high = (np.array([points[x][i] for x in xs]) * scale for i in range(3))
        ax.errorbar(
            [place[x] for x in xs], mean, yerr=[mean - low, high - mean], marker="o", capsize=3, label=label
        )
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
    # plain tick labels at the values run (4, 8, 16; not 4x10^0), inf where alpha=inf was run
    ax.set_xticks([place[x] for x in xs_all], [_tick(x) for x in xs_all])
    ax.xaxis.set_minor_formatter(_null_formatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(table.title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = out_dir / f"{table.name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _x_positions(xs: Sequence[float], logx: bool) -> dict[float, float]:
    """Where each column value goes on the x axis: inf one decade (log) or one step past the largest."""
    finite = [x for x in xs if np.isfinite(x)]
    top = max(finite) if finite else 1.0
    inf_at = top * 10 if logx else top + (top - min(finite) if len(finite) > 1 else 1.0)
    return {x: (x if np.isfinite(x) else inf_at) for x in xs}


def _tick(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:g}"


def _null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _plain_log_ticks(axis) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(_null_formatter())


def write_plots(tables: Sequence[Table], out_dir: Path) -> list[Path]:
    paths: list[Path] = []
    for table in tables:
        if table.kind == "accuracy":
            paths += plot_curves(table, out_dir)
            path = plot_series(
                table, out_dir, "alpha (Dirichlet heterogeneity)", "test accuracy (%)", logx=True
            )
        elif table.kind == "scaling":
            path = plot_series(table, out_dir, "workers", "test accuracy (%)", logx=True)
        elif table.kind == "robustness":
            path = plot_series(table, out_dir, "drop probability", "test accuracy (%)", logx=False)
        elif table.kind == "quadratics":
            path = plot_series(
                table, out_dir, "workers", "steps to target", logx=True, logy=True, percent=False
            )
        else:
            path = None
        if path is not None:
            paths.append(path)
    return paths

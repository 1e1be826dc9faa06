"""PNG plots for the report: accuracy over epochs and over wall-clock time, accuracy vs alpha,
scaling and quadratics."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from relaympi.report.summary import Curve
from relaympi.report.tables import Table

if TYPE_CHECKING:  # matplotlib loads only when a plot is drawn
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Beyond ten series the colours repeat: every ten, the next line style and marker (4 and 7 of
# them, coprime), so the (colour, line style, marker) of a plot's series stay distinct up to 280.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_COLOURS = 10  # matplotlib's default cycle, tab10


def series_style(index: int) -> dict[str, str]:
    """Colour, line style and marker of a plot's ``index``-th series."""
    round_ = index // _COLOURS
    return {
        "color": f"C{index % _COLOURS}",
        "linestyle": _LINESTYLES[round_ % len(_LINESTYLES)],
        "marker": _MARKERS[round_ % len(_MARKERS)],
    }


CURVES_CAPTION = (
    "line: mean test accuracy over workers; band: worst to best worker; each averaged over seeds "
    "(per evaluation; the longest seed alone where the seeds' evaluations differ)"
)
# added to CURVES_CAPTION where a run lost workers
CHANGES_CAPTION = (
    "; dotted vertical line: a membership change (workers lost), in the series' colour"
)
TIME_CAPTION = (
    "line: worst worker's test accuracy per evaluation over wall-clock seconds since "
    "training started "
    "(evaluations included), averaged over seeds (time and accuracy per evaluation; the "
    "longest seed alone "
    "where the seeds' evaluations differ); dashed: the cost table's target accuracy"
)
SERIES_CAPTION = (
    "point: {metric}, mean over seeds; bars: min to max over seeds; diverged seeds left out"
)


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


# Figure geometry, in inches and points: the axes keep their size whatever the labels; the
# figure grows downwards by the legend's height.
_WIDTH = 8.0
_AXES_HEIGHT = 3.6
_TITLE_PT, _CAPTION_PT, _LEGEND_PT = 9, 7, 7
_CHARS_PER_INCH = {9: 12.5, 7: 16.0}  # DejaVu Sans, a little under its average, so lines fit


def literal(text: str) -> str:
    """``text`` as matplotlib shows it literally: each ``$`` escaped, so that a pair of them (in a
    label from a run file) is never parsed as mathtext, which fails on an unknown command.

    Args:
        text: a title, caption or series label.

    Returns:
        The text with every ``$`` written ``\\$``.
    """
    return text.replace("$", "\\$")


def _wrap(text: str, points: int, width: float) -> str:
    return "\n".join(textwrap.wrap(literal(text), int(_CHARS_PER_INCH[points] * (width - 0.4))))


# Any: matplotlib's stubs refuse the options passed here as dicts (**style, **options)
def _figure(title: str, caption: str, width: float = _WIDTH) -> tuple[Any, Any]:
    """A figure with one axes, the title on top and the caption (what lines and bands are) under
    it, each wrapped to the figure's width; _legend puts the legend under the axes (constrained
    layout keeps them all apart)."""
    plt = _pyplot()
    title, caption = _wrap(title, _TITLE_PT, width), _wrap(caption, _CAPTION_PT, width)
    lines = title.count("\n") + caption.count("\n") + 2
    fig, ax = plt.subplots(figsize=(width, _AXES_HEIGHT + 0.9 + 0.13 * lines), layout="constrained")
    fig.suptitle(title, fontsize=_TITLE_PT)
    ax.set_title(caption, fontsize=_CAPTION_PT)
    return fig, ax


def _legend(fig: Any, ax: Any) -> None:
    """The legend under the axes, outside them: it covers neither data, title nor caption. As
    many columns as the longest entry allows, and the figure made taller by the legend's height,
    so that long or many entries never shrink the axes."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    options = {"loc": "outside lower center", "fontsize": _LEGEND_PT, "frameon": False}
    renderer = fig.canvas.get_renderer()
    probe = fig.legend(handles, labels, ncols=1, **options)
    entry = probe.get_window_extent(renderer).width / fig.dpi  # the widest entry, in inches
    probe.remove()
    ncols = max(1, min(len(labels), int((fig.get_figwidth() - 0.3) / max(entry, 0.1))))
    legend = fig.legend(handles, labels, ncols=ncols, **options)
    height = legend.get_window_extent(renderer).height / fig.dpi
    fig.set_figheight(fig.get_figheight() + height + 0.2)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def curves_figure(title: str, by_label: dict[str, list[Curve]]) -> Figure:
    """Test accuracy over epochs, one line and band per series (see CURVES_CAPTION), and a dotted
    vertical line at each membership change of a series' runs (CHANGES_CAPTION)."""
    changed = any(c.changes for curves in by_label.values() for c in curves)
    fig, ax = _figure(title, CURVES_CAPTION + (CHANGES_CAPTION if changed else ""))
    for index, (label, curves) in enumerate(by_label.items()):
        curve = _mean_curve(curves)
        style = series_style(index)
        ax.plot(
            curve.epoch,
            100 * curve.mean,
            label=literal(label),
            markersize=4,
            markevery=max(1, len(curve.epoch) // 8),
            **style,
        )
        ax.fill_between(
            curve.epoch, 100 * curve.worst, 100 * curve.best, color=style["color"], alpha=0.2
        )
        for epoch in sorted({e for c in curves for e in c.changes if np.isfinite(e)}):
            ax.axvline(epoch, color=style["color"], linestyle=":", linewidth=1.2, gid="membership")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return fig


def _mean_time_curve(seeds: Sequence[tuple[np.ndarray, Curve]]) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, worst worker accuracy) per evaluation, averaged over the seeds that share the
    longest seed's evaluation epochs, else the longest seed's."""
    time_s, longest = max(seeds, key=lambda tc: len(tc[1].epoch))
    same = [
        (t, c)
        for t, c in seeds
        if len(c.epoch) == len(longest.epoch) and np.allclose(c.epoch, longest.epoch)
    ]
    if len(same) < 2:
        return np.asarray(time_s, dtype=float), longest.worst
    return np.mean([t for t, _ in same], axis=0), np.mean([c.worst for _, c in same], axis=0)


def time_figure(table: Table) -> Figure:
    """Worst-worker test accuracy over wall-clock time, one line per cost-table row
    (TIME_CAPTION)."""
    # the hardware goes in the caption: it is long
    family, _, hardware = table.title.partition(" -- ")
    fig, ax = _figure(
        family,
        f"{hardware}. {TIME_CAPTION[0].upper()}{TIME_CAPTION[1:]}" if hardware else TIME_CAPTION,
    )
    for index, (label, seeds) in enumerate(table.time_curves.items()):
        if not seeds:
            continue
        seconds, worst = _mean_time_curve(seeds)
        ax.plot(
            seconds,
            100 * worst,
            label=literal(label),
            markersize=4,
            markevery=max(1, len(seconds) // 8),
            **series_style(index),
        )
    if table.target is not None:
        ax.axhline(
            100 * table.target,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label=f"target {100 * table.target:.1f}%",
        )
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("worst worker's test accuracy (%)")
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return fig


def plot_time(table: Table, out_dir: Path) -> Path | None:
    """A cost table's accuracy over wall-clock time as time_<table name>.png (None: no curves)."""
    if not any(table.time_curves.values()):
        return None
    return _save(time_figure(table), out_dir / f"time_{table.name}.png")


def plot_curves(table: Table, out_dir: Path) -> list[Path]:
    """Per alpha: mean worker test accuracy over epochs, band from worst to best worker."""
    paths = []
    for alpha, by_label in table.curves.items():
        by_label = {label: curves for label, curves in by_label.items() if curves}
        if not by_label:
            continue
        title = f"{table.title}, alpha={alpha:g}" if alpha is not None else table.title
        name = (
            f"curves_{table.name}_alpha{alpha:g}.png"
            if alpha is not None
            else f"curves_{table.name}.png"
        )
        paths.append(_save(curves_figure(title, by_label), out_dir / name))
    return paths


def series_figure(
    table: Table,
    xlabel: str,
    ylabel: str,
    *,
    logx: bool,
    logy: bool = False,
    percent: bool = True,
) -> Figure | None:
    """One line per table row (algorithm, settings and topology) over the columns, min-max error
    bars (see SERIES_CAPTION); None when fewer than two column values have points."""
    series = {label: points for label, points in table.series.items() if points}
    if len({x for points in series.values() for x in points}) < 2:
        return None
    scale = 100 if percent else 1
    xs_all = sorted({x for points in series.values() for x in points})
    place = _x_positions(xs_all, logx)
    fig, ax = _figure(table.title, SERIES_CAPTION.format(metric=table.metric or ylabel))
    for index, (label, points) in enumerate(series.items()):
        xs = sorted(points)
        mean, low, high = (np.array([points[x][i] for x in xs]) * scale for i in range(3))
        ax.errorbar(
            [place[x] for x in xs],
            mean,
            yerr=[mean - low, high - mean],
            capsize=3,
            label=literal(label),
            **series_style(index),
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
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return fig


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
    """``series_figure`` saved as <table name>.png (None: nothing to plot)."""
    fig = series_figure(table, xlabel, ylabel, logx=logx, logy=logy, percent=percent)
    return None if fig is None else _save(fig, out_dir / f"{table.name}.png")


def _x_positions(xs: Sequence[float], logx: bool) -> dict[float, float]:
    """Where each column value goes on the x axis: inf one decade (log) or one step past the
    largest."""
    finite = [x for x in xs if np.isfinite(x)]
    top = max(finite) if finite else 1.0
    inf_at = top * 10 if logx else top + (top - min(finite) if len(finite) > 1 else 1.0)
    return {x: (x if np.isfinite(x) else inf_at) for x in xs}


def _tick(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:g}"


def _null_formatter() -> NullFormatter:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _plain_log_ticks(axis: Axis) -> None:
    """Ticks labelled plainly (20, not 2x10^1), at 1, 2 and 5 times the powers of ten; at nice
    round numbers where the data span less than a decade (so some tick is always labelled)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    axis.axes.autoscale_view()
    low, high = axis.get_view_interval()
    narrow = low > 0 and high / low < 10
    axis.set_major_locator(
        MaxNLocator(nbins=6) if narrow else LogLocator(base=10, subs=(1.0, 2.0, 5.0))
    )
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(_null_formatter())


def table_plots(table: Table, out_dir: Path) -> list[Path]:
    """The PNG plots of one table, written into ``out_dir`` (none for the learning-rate tables)."""
    paths: list[Path] = []
    if table.kind == "accuracy":
        paths += plot_curves(table, out_dir)
        path = plot_series(
            table, out_dir, "alpha (Dirichlet heterogeneity)", "test accuracy (%)", logx=True
        )
    elif table.kind == "scaling":
        path = plot_series(table, out_dir, "workers", "test accuracy (%)", logx=True)
    elif table.kind == "robustness":
        path = plot_series(table, out_dir, "drop probability", "test accuracy (%)", logx=False)
    elif table.kind == "cost":
        path = plot_time(table, out_dir)
    elif table.kind == "quadratics":
        path = plot_series(
            table, out_dir, "workers", "steps to target", logx=True, logy=True, percent=False
        )
    else:
        path = None
    return paths if path is None else [*paths, path]


def write_plots(tables: Sequence[Table], out_dir: Path) -> list[Path]:
    """Every table's plots (table_plots), in the tables' order."""
    return [path for table in tables for path in table_plots(table, out_dir)]

"""The report's plots say what they show and keep every series apart; the command
lines' help, usage lines and advice are complete and lead somewhere."""

# Long module: every command's --help and every plot the report draws

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT

pytest.importorskip("matplotlib")

# ----------------------------------------------------------------------------------------- plots

WORKERS = 3
EVALS = 8


def _figure_text(fig) -> str:
    from matplotlib.text import Text

    # wrapped lines joined
    return " ".join(" ".join(t.get_text() for t in fig.findobj(Text)).split())


def _data_lines(ax) -> list:
    """One Line2D per legend entry (an errorbar's entry is a container: its first item is the
    line)."""
    handles, _ = ax.get_legend_handles_labels()
    return [h if hasattr(h, "get_linestyle") else h[0] for h in handles]


def _style(line) -> tuple:
    from matplotlib.colors import to_rgba

    return (to_rgba(line.get_color()), line.get_linestyle(), line.get_marker())


def _many_series_table(count: int):
    from relaympi.report.tables import Table

    series = {
        f"algorithm {i} on ring": {
            0.0: (0.5 + 0.01 * i, 0.49, 0.52 + 0.01 * i),
            0.1: (0.4 + 0.01 * i, 0.39, 0.41 + 0.01 * i),
        }
        for i in range(count)
    }
    return Table(
        name="robustness_digits_alpha0.1_n4",
        title="Robustness",
        caption="",
        header=[],
        rows=[],
        kind="robustness",
        metric="the worst worker's mean test accuracy over the last 5 epochs",
        series=series,
    )


def _curves(count: int) -> dict:
    from relaympi.report.summary import Curve

    epoch = np.arange(1.0, EVALS + 1)
    return {
        f"algorithm {i} on chain": [
            Curve(epoch, 0.1 * epoch / EVALS, 0.2 * epoch / EVALS + 0.01 * i, 0.3 * epoch / EVALS)
        ]
        for i in range(count)
    }


@pytest.mark.parametrize("count", [14, 45])
def test_every_series_of_a_plot_has_its_own_colour_line_style_and_marker(count: int) -> None:
    from relaympi.report.plots import curves_figure, series_figure

    series = series_figure(
        _many_series_table(count), "drop probability", "test accuracy (%)", logx=False
    )
    curves = curves_figure("Test accuracy", _curves(count))
    assert series is not None
    for fig in (series, curves):
        lines = _data_lines(fig.axes[0])
        assert len(lines) == count
        styles = [_style(line) for line in lines]
        assert len(set(styles)) == count, styles
        # the first ten differ by colour alone, as before (tab10)
        assert len({s[0] for s in styles[:10]}) == 10


@pytest.mark.parametrize("count", [3, 14])
def test_the_legend_is_outside_the_axes_and_inside_the_figure(count: int) -> None:
    from relaympi.report.plots import curves_figure, series_figure

    series = series_figure(
        _many_series_table(count), "drop probability", "test accuracy (%)", logx=False
    )
    curves = curves_figure("Test accuracy", _curves(count))
    assert series is not None
    for fig in (series, curves):
        fig.canvas.draw()
        (ax,) = fig.axes
        legends: list[Any] = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
        assert len(legends) == 1
        box, axes_box = legends[0].get_window_extent(), ax.get_window_extent()
        assert not box.overlaps(axes_box), (box, axes_box)
        tight = ax.get_tightbbox()
        assert tight is not None and box.y1 <= tight.y0  # under the axes, tick labels, x label
        figure_box = fig.bbox
        # not clipped
        assert box.x1 <= figure_box.x1 + 1 and box.y1 <= figure_box.y1 + 1 and box.y0 >= -1


def _write_runs(directory: Path) -> dict[tuple[str, int], np.ndarray]:
    """Two seeds of relay and of d2 on digits at alpha 0.1, workers rising at different rates."""
    from tests import run_factories as rf

    accuracies = {}
    ramp = np.linspace(0.1, 1.0, EVALS)[:, None]
    for algo, top in (("relay", 0.9), ("d2", 0.7)):
        for seed in range(2):
            acc = ramp * (top - 0.1 * np.arange(WORKERS) - 0.05 * seed)[None, :] + 0.02 * seed
            for drop in (0.0, 0.1):
                rf.write_classification_run(
                    directory / f"{algo}_{seed}_{drop}.h5",
                    acc * (1 - drop),
                    task="digits",
                    algo=algo,
                    alpha=0.1,
                    seed=seed,
                    drop_prob=drop,
                    lr=0.1,
                )
            accuracies[(algo, seed)] = acc
    return accuracies


def test_each_plot_says_what_its_lines_bands_and_bars_are(tmp_path: Path) -> None:
    """The caption names the reduction over workers and seeds; the drawn numbers are that
    reduction."""
    from relaympi import report
    from relaympi.report.plots import curves_figure, series_figure
    from relaympi.report.summary import ReportSettings
    from relaympi.report.tables import all_tables

    accuracies = _write_runs(tmp_path)
    settings = ReportSettings()
    runs, _ = report.load_runs(report.find_run_files([tmp_path]), settings)
    tables = {t.name: t for t in all_tables(runs, settings)}

    accuracy = tables["accuracy_digits_n3"]  # the reliable runs
    (by_label,) = accuracy.curves.values()
    fig = curves_figure(accuracy.title, by_label)
    text = _figure_text(fig)
    assert "line: mean test accuracy over workers" in text
    assert "band: worst to best worker" in text and "averaged over seeds" in text
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    relay_line = _data_lines(ax)[
        labels.index(next(lbl for lbl in labels if lbl.startswith("RelaySGD")))
    ]
    seeds = [accuracies[("relay", s)] for s in range(2)]
    np.testing.assert_allclose(
        np.asarray(relay_line.get_ydata()), 100 * np.mean([a.mean(axis=1) for a in seeds], axis=0)
    )
    collection = ax.collections[labels.index(relay_line.get_label())]
    band = np.asarray(collection.get_paths()[0].vertices)[:, 1]
    worst = 100 * np.mean([a.min(axis=1) for a in seeds], axis=0)
    best = 100 * np.mean([a.max(axis=1) for a in seeds], axis=0)
    assert np.allclose(band.min(), worst.min()) and np.allclose(band.max(), best.max())
    assert all(np.isclose(band, w).any() for w in worst) and all(
        np.isclose(band, b).any() for b in best
    )

    robustness = tables["robustness_digits_alpha0.1_n3"]
    series = series_figure(robustness, "drop probability", "test accuracy (%)", logx=False)
    assert series is not None
    text = _figure_text(series)
    assert (
        "point: the worst worker's mean test accuracy over the last 5 epochs, mean over seeds"
        in text
    )
    assert "bars: min to max over seeds" in text
    ax = series.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    # an ErrorbarContainer (Any: matplotlib types ax.containers as the base Container)
    container: Any = ax.containers[
        next(i for i, lbl in enumerate(labels) if lbl.startswith("RelaySGD"))
    ]
    # worst worker, last 5 epochs
    metric = [min(a[-5:, w].mean() for w in range(WORKERS)) for a in seeds]
    np.testing.assert_allclose(container.lines[0].get_ydata()[0], 100 * np.mean(metric))
    segment = container.lines[2][0].get_segments()[0]  # the error bar at drop 0
    np.testing.assert_allclose(sorted(segment[:, 1]), [100 * min(metric), 100 * max(metric)])


def test_the_report_writes_the_plots(tmp_path: Path) -> None:
    from relaympi import report

    _write_runs(tmp_path / "runs")
    out = tmp_path / "out"
    assert report.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "robustness_digits_alpha0.1_n3.png" in pngs and any(
        p.startswith("curves_") for p in pngs
    )


# ---------------------------------------------------------------------------------- data advice


@pytest.fixture
def cifar_source(tmp_path, monkeypatch):
    """Cifar10 fetches a small CIFAR-10-format tarball from a file:// URL (with its md5)."""
    import hashlib

    from relaympi.data.sets import Cifar10, RemoteFile
    from tests.test_data import ARCHIVE, cifar_tarball

    monkeypatch.delenv("RELAYMPI_DATA", raising=False)
    monkeypatch.delenv("RELAYMPI_DATA_MIRROR", raising=False)
    blob, _ = cifar_tarball(tmp_path)
    source = tmp_path / "source" / ARCHIVE
    source.parent.mkdir()
    source.write_bytes(blob)
    monkeypatch.setattr(
        Cifar10, "files", (RemoteFile(ARCHIVE, source.as_uri(), hashlib.md5(blob).hexdigest()),)
    )


def _follow(advice: str) -> None:
    """Run advice of the form `mv A B && python -m relaympi.data ARGS` as a user would
    (in-process)."""
    from relaympi.commands import data as cli

    for command in advice.split(" && "):
        words = shlex.split(command)
        if words[0] == "mv":
            assert len(words) == 3 and not Path(words[2]).exists()
            os.rename(words[1], words[2])
        else:
            assert words[:3] == ["python", "-m", "relaympi.data"], command
            assert cli.main(words[3:]) == 0, command


def _check(root: Path, capsys) -> tuple[int, str]:
    from relaympi.commands import data as cli

    status = cli.main(["check", "cifar10", "--root", str(root)])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("damage", ["complete", "incomplete"])
def test_following_checks_advice_for_data_put_there_by_hand_verifies_it(
    tmp_path, cifar_source, capsys, damage
):
    from tests.data_factories import write_cifar10_binary

    root = tmp_path / "data root"
    write_cifar10_binary(root / "cifar10", n_per_batch=2)
    if damage == "incomplete":
        (root / "cifar10" / "cifar-10-batches-bin" / "test_batch.bin").unlink()
    status, out = _check(root, capsys)
    assert status == 1 and ("unverified" if damage == "complete" else "incomplete") in out
    (advice,) = [line.split("-> ", 1)[1] for line in out.splitlines() if "-> " in line]
    if damage == "complete":
        assert advice.startswith("usable as it is (complete); to have it verified: ")
        advice = advice.split("verified: ", 1)[1]
    _follow(advice)
    status, out = _check(root, capsys)
    assert status == 0 and "cifar10     verified" in out
    # kept
    assert (root / "cifar10.by-hand" / "cifar-10-batches-bin" / "data_batch_1.bin").is_file()


def test_following_the_jobs_data_advice_and_the_trainers_hint_verifies_it(
    tmp_path, cifar_source, capsys
):
    from relaympi.data.paths import fetch_hint
    from relaympi.data.sets import data_problems
    from tests.data_factories import write_cifar10_binary

    root = tmp_path / "root"
    write_cifar10_binary(root / "cifar10", n_per_batch=2)
    (problem,) = data_problems([("cifar10", root / "cifar10")])
    hint = fetch_hint("cifar10", root / "cifar10")
    assert "unverified" in problem and "`mv " in hint
    _follow(problem.split("run `", 1)[1].rstrip("`"))
    assert data_problems([("cifar10", root / "cifar10")]) == []
    # a verified or corrupt copy (it has a manifest): fetch alone, which repairs it
    assert (
        fetch_hint("cifar10", root / "cifar10")
        == f"Get it with `python -m relaympi.data fetch cifar10 --root {shlex.quote(str(root))}`."
    )


def test_fetch_refusing_a_folder_gives_the_command_that_works(tmp_path, cifar_source, capsys):
    from relaympi.commands import data as cli
    from tests.data_factories import write_cifar10_binary

    write_cifar10_binary(tmp_path / "cifar10", n_per_batch=2)
    assert cli.main(["fetch", "cifar10", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    _follow(err.split("move it away and fetch: `", 1)[1].split("`", 1)[0])
    assert _check(tmp_path, capsys)[0] == 0


def test_fetch_lists_only_what_it_can_fetch(capsys):
    from relaympi.commands import data as cli
    from relaympi.data.sets import FETCHABLE

    for name in ("nonsense", "imagenet"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["fetch", name])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1  # one line, no usage block
        assert err.endswith("(see `python -m relaympi.data fetch --help`)\n")
        assert "imagenet'" not in err and "'imagenet" not in err
    assert f"choose from {', '.join(FETCHABLE)})" in cli_error(["fetch", "nonsense"], capsys)
    assert "prepare-imagenet" in cli_error(["fetch", "cifar10", "imagenet"], capsys)


def cli_error(argv: list[str], capsys) -> str:
    from relaympi.commands import data as cli

    with pytest.raises(SystemExit):
        cli.main(argv)
    return capsys.readouterr().err


# -------------------------------------------------------------------------------------- jobs/

JOBS = ROOT / "jobs"
SMALL_GRID = {
    "RELAYMPI_WORKERS": "4",
    "RELAYMPI_SEEDS": "0",
    "RELAYMPI_ALPHAS": "0.1",
    "RELAYMPI_MOMENTA": "0",
    "RELAYMPI_LAUNCHER": "local",
}


def _jobs_script(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYMPI_") and k != "DRY_RUN"}
    env.update(
        PYTHONPATH=str(ROOT),
        RELAYMPI_PYTHON=sys.executable,
        RELAYMPI_RESULTS_DIR=str(tmp_path / "results"),
        **SMALL_GRID,
        **settings,
    )
    return subprocess.run(
        ["bash", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )


def _refusals(stderr: str) -> str:
    """stderr without submit.sh's own lines (the sbatch commands it would run)."""
    return "\n".join(
        line for line in stderr.splitlines() if " configuration(s) with --ntasks=" not in line
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no data", "a refused configuration"])
def test_a_listing_refuses_and_warns_as_submit_dry_run_does(tmp_path: Path, case: str) -> None:
    (tmp_path / "empty root").mkdir()
    settings = (
        {
            "RELAYMPI_TASK": "cifar10",
            "RELAYMPI_ALGOS": "relay",
            "RELAYMPI_DATA": str(tmp_path / "empty root"),
        }
        if case == "no data"
        else {"RELAYMPI_TASK": "digits", "RELAYMPI_ALGOS": "relay:ring"}
    )
    listing = _jobs_script(tmp_path, str(JOBS / "sweep_alpha.sh"), DRY_RUN="1", **settings)
    dry_run = _jobs_script(
        tmp_path, str(JOBS / "submit.sh"), "sweep_alpha", "--dry-run", **settings
    )
    assert "[0] missing" in listing.stdout  # the listing itself is there
    assert listing.returncode == dry_run.returncode == (0 if case == "no data" else 2), (
        listing.stderr,
        dry_run.stderr,
    )
    assert _refusals(listing.stderr) == _refusals(dry_run.stderr)
    if case == "no data":
        assert (
            "warning:" in listing.stderr
            and "python -m relaympi.data fetch cifar10" in listing.stderr
        )
    else:
        assert "error:" in listing.stderr and "not a tree" in listing.stderr


def test_submit_help_exits_0_and_names_every_option(tmp_path: Path) -> None:
    for args in (["--help"], ["-h"], ["sweep_alpha", "--help"]):
        proc = _jobs_script(tmp_path, str(JOBS / "submit.sh"), *args)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: bash jobs/submit.sh SWEEP")
        for option in ("--all", "--dry-run", "--wait", "sbatch"):
            assert option in proc.stdout
    proc = _jobs_script(tmp_path, str(JOBS / "submit.sh"))
    assert proc.returncode == 2 and "--wait" in proc.stderr


# ------------------------------------------------------------------------------------ --help

# value-taking options of relaympi.train without a default value (nothing is assumed for them)
NO_DEFAULT = {"--config", "--steps", "--workers", "--problem-file", "--save-problem"}
TASK_DEPENDENT = (
    "momentum",
    "optimizer",
    "weight_decay",
    "batch_size",
    "epochs",
    "warmup_epochs",
    "milestones",
)


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value) or "none"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def test_train_help_shows_every_default() -> None:
    from relaympi.config import RunConfig, build_parser
    from relaympi.tasks import TASK_NAMES, get_task_class
    from relaympi.tasks.quadratics import QuadraticsSpec

    config, spec = RunConfig(), QuadraticsSpec()
    actions = {
        a.option_strings[0]: a
        for a in build_parser()._actions
        if a.option_strings and a.dest != "help"
    }
    for flag, action in actions.items():
        text = " ".join((action.help or "").split())
        assert text, flag
        # on/off flags, and options with nothing assumed
        if action.nargs == 0 or flag in NO_DEFAULT:
            continue
        assert "default" in text.lower(), f"{flag}: {text}"
        assert "the task's" not in text, f"{flag}: say 'task default: ...' ({text})"
        value = getattr(config, action.dest, None)
        if value is None and hasattr(spec, action.dest):
            value = getattr(spec, action.dest)  # the generated quadratics problem's constants
        if value is not None:
            assert f"default {_shown(value)}" in text or f"default {value}" in text, (
                f"{flag}: {text}"
            )
        if action.dest in TASK_DEPENDENT:
            assert "task default: " in text, f"{flag}: {text}"
            for task in TASK_NAMES:
                if task == "quadratics" and action.dest == "epochs":
                    assert "(quadratics: --steps)" in text
                    continue
                shown = _shown(getattr(get_task_class(task).defaults, action.dest))
                assert f"{task} {shown}" in text, f"{flag}: {task} {shown} not in {text}"
    for flag in ("--threads", "--epochs", "--batch-size", "--momentum", "--eval-every"):
        assert "default" in str(actions[flag].help)
    evals = " ".join(str(actions["--eval-every"].help).split())
    assert (
        "task default: " in evals
        and "quadratics 200 evaluations per run" in evals
        and "digits every epoch" in evals
    )
    assert "agnews: relay chain" in " ".join(str(actions["--topology"].help).split())


def test_every_task_takes_its_defaults_from_the_torch_free_table() -> None:
    """--help reads relaympi.tasks.defaults, never a task's class (which imports torch): each
    registered task has its line there, in the registry's order, and its class uses that line."""
    from relaympi.algorithms import ALGORITHM_NAMES
    from relaympi.tasks import TASK_NAMES, get_task_class
    from relaympi.tasks.defaults import DEFAULT_TOPOLOGY_BY_ALGO, TASK_DEFAULTS
    from relaympi.topology import TOPOLOGY_NAMES

    assert tuple(TASK_DEFAULTS) == TASK_NAMES
    for task in TASK_NAMES:
        assert get_task_class(task).defaults is TASK_DEFAULTS[task], task
    for task, own in DEFAULT_TOPOLOGY_BY_ALGO.items():
        assert task in TASK_NAMES and set(own) <= set(ALGORITHM_NAMES), task
        assert set(own.values()) <= set(TOPOLOGY_NAMES), task


@pytest.mark.parametrize("module", ["benchmarks.comm", "benchmarks.bench_report"])
def test_every_benchmark_option_has_help(module: str) -> None:
    import importlib

    parser = importlib.import_module(module).build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), (
            f"{module} {action.option_strings or action.dest}: no help"
        )
        if action.option_strings and action.default not in (None, False) and action.dest != "help":
            assert "default" in action.help, f"{module} {action.option_strings}: {action.help}"


def _entry_points() -> list[str]:
    """Every `python -m` module of relaympi/ and benchmarks/: a __main__.py package, or a module
    with an `if __name__ == "__main__":` block."""
    modules = []
    for package in ("relaympi", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if path.name == "__main__.py":
                modules.append(".".join(parts[:-1]))
            elif 'if __name__ == "__main__":' in path.read_text(encoding="utf-8"):
                modules.append(".".join(parts))
    return modules


@pytest.mark.slow
def test_every_entry_point_calls_itself_python_m_module() -> None:
    modules = _entry_points()
    assert {
        "relaympi.train",
        "relaympi.data",
        "relaympi.report",
        "relaympi.studies.quadratics",
        "benchmarks.report",
        "benchmarks.comm",
        "benchmarks.engines",
    } <= set(modules)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {  # all at once: each mostly waits for its imports
        m: subprocess.Popen(
            [sys.executable, "-m", m, "--help"],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for m in modules
    }
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{module}: {err}"
        assert out.startswith(f"usage: python -m {module} "), f"{module}: {out.splitlines()[:1]}"

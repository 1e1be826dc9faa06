"""The command line of `python -m relaympi.train` and its flag table, both from RunConfig's
Flags."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relaympi.config import run_config
from relaympi.config.applies import not_applicable
from relaympi.config.flags import ConfigError, Flag, plain, text
from relaympi.config.run_config import RUN_FILE_ONLY_KEYS, RunConfig
from relaympi.config.validation import validate
from relaympi.entrypoint import UsageParser
from relaympi.launcher import launch
from relaympi.topology import TOPOLOGY_NAMES

# --config: not a RunConfig field (a file of them)
CONFIG = Flag(
    "JSON file of saved flags (as written in a run file's `config`), or a run file (.h5) to rerun "
    "or vary (its `config`, less its `--overwrite` and every path it names, which a warning "
    "lists); flags given on the command line win",
    type=Path,
    metavar="FILE",
)
# what a run file's config records of where that run's own files went: a rerun from the file
# chooses its own (a completed run is not replaced, a checkpoint belongs to its run file)
RUN_FILE_OWN_KEYS = ("out", "checkpoint_dir", "overwrite")
# a run file may come from anyone: the files its config names (to write, like --save-problem, or
# to read) are its author's choice, so a rerun from it takes none of them; the command line gives
# its own. Every path-valued flag, and a topology read from an edge-list file.
RUN_FILE_PATH_KEYS = tuple(f.name for f, flag in run_config.FLAGS if flag.type is Path)
EDGE_LIST_PREFIX = "edge-list:"


def _title(group: str) -> str:
    return group.replace("`", "")


def flag_table() -> str:
    """The table of the flags of `python -m relaympi.train` (Markdown), from the Flags: one row per
    flag, its text as --help shows it (with its code marked), a group's title before its flags.

    Returns:
        The Markdown table, a header and one line per row, ending in a newline.
    """
    rows = [_row("config", CONFIG)]
    group = None
    for f, flag in run_config.FLAGS:  # read at each call: a test may add a flag
        if flag.group is not None and flag.group != group:
            rows.append(f"| {_cell(flag.group)} | |")
        group = flag.group
        rows.append(_row(f.name, flag))
    return "\n".join(["| flag | meaning (default) |", "| --- | --- |", *rows]) + "\n"


def _row(name: str, flag: Flag) -> str:
    option = flag.option_string(name)
    if flag.negatable:
        usage = f"`{option}`, `--no-{option[2:]}`"
    elif flag.switch:
        usage = f"`{option}`"
    elif flag.choices:
        usage = f"`{option} {{{','.join(flag.choices())}}}`"
    else:
        usage = f"`{option} {flag.metavar_of(name)}`"
    return f"| {usage} | {_cell(text(name, flag))} |"


def _cell(markdown: str) -> str:
    return markdown.replace("|", "\\|")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m relaympi.train`, generated from RunConfig's Flags (and --config)."""
    p = UsageParser(
        prog="python -m relaympi.train",
        description="Train with a decentralized algorithm: one worker per MPI rank (mpirun/srun), "
        "--backend local --workers N (threads of one process), or --backend batched --workers N "
        "(one batched computation on one device). Writes one HDF5 run file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(
            [
                "topologies (--topology):",
                *textwrap.wrap(
                    ", ".join(TOPOLOGY_NAMES) + ",", 96, initial_indent="  ", subsequent_indent="  "
                ),
                "  spanning-tree:<name> (the Spanning Tree Protocol tree of a graph), "
                "edge-list:<file> ('i j' per line)",
                "",
                "default learning rates: tuned for 16 workers on each algorithm's default "
                "topology (the paper's",
                "  tables for cifar10 and agnews, the centralized recipe for imagenet, a "
                "sweep for digits); a run",
                "  with more workers, or fewer than a quarter as many (all-reduce: only more), "
                "warns, and the",
                "  end summary flags workers at chance accuracy after an epoch: pass --lr.",
                "",
                "one worker (--workers 1, or mpirun -n 1) with --algo allreduce is the "
                "centralized baseline.",
                "",
                "exit status: 0 completed, 1 failed, 2 usage error (nothing written), 3 "
                "diverged (recorded),",
                "  4 preempted by SIGTERM, SIGUSR1 or Ctrl-C (checkpoint saved; run the "
                "same command again to resume),",
                "  5 stopped by such a signal without a checkpoint (no --checkpoint-dir: "
                "a rerun starts over)",
            ]
        ),
    )
    p.add_argument(
        "--config", type=Path, metavar=CONFIG.metavar, help=plain(text("config", CONFIG))
    )
    groups: dict[str, Any] = {}
    for f, flag in run_config.FLAGS:  # read at each call: a test may add a flag
        target: Any = p
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = p.add_argument_group(_title(flag.group))
            target = groups[flag.group]
        option, words = flag.option_string(f.name), plain(text(f.name, flag))
        if flag.negatable:  # --name / --no-name (None: not given)
            target.add_argument(
                option, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=words
            )
        elif flag.switch:  # given, it stores the opposite of the field's default (None: not given)
            target.add_argument(
                option,
                dest=f.name,
                default=None,
                help=words,
                action="store_false" if f.default else "store_true",
            )
        else:
            target.add_argument(
                option,
                type=flag.type,
                metavar=flag.metavar,
                help=words,
                choices=flag.choices() if flag.choices else None,
            )
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """RunConfig from the command line: ``--config FILE`` (a JSON object of flags, or a run
    file's config) first, then the flags given, which win.

    Args:
        argv: the arguments after the program name; None: ``sys.argv[1:]``.

    Returns:
        The validated RunConfig; ``None`` fields still mean "the task's default".

    Raises:
        ConfigError: a bad value or combination, an unreadable --config, or a flag that does not
            apply to the run's task or algorithm.
        SystemExit: argparse misuse (an unknown flag, a missing value), with status 2; --help
            exits with 0.

    Example:
        ```python
        cfg = parse_args(["--task", "digits", "--algo", "relay", "--alpha", "0.01"])
        cfg.topology  # None: relay's default, resolved when the run is planned
        ```
    """
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    base: dict[str, Any] = {}
    if args.config is not None:
        values, dropped = _read_config(Path(args.config))
        base = checked_values(values, f"--config {args.config}")
        _warn_dropped(args.config, {k: v for k, v in dropped.items() if k not in given})
    for key in RUN_FILE_ONLY_KEYS:  # a run file's config records these derived values too
        base.pop(key, None)
    if "steps" in given or "epochs" in given:  # a length on the command line replaces the file's
        base.pop("steps", None)
        base.pop("epochs", None)
    cfg = RunConfig.from_dict({**base, **given})
    # a run file's config records every key; those that cannot apply to this run's task or
    # algorithm are dropped from the file's (only flags given on the command line are refused)
    stale = {f.lstrip("-").replace("-", "_") for f, _ in not_applicable(cfg)} - set(given)
    if stale:
        cfg = RunConfig.from_dict({**{k: v for k, v in base.items() if k not in stale}, **given})
    validate(cfg)
    return cfg


def read_config(path: Path) -> dict[str, Any]:
    """The flags --config FILE holds: a JSON object, or a run file's `config` attribute (less
    RUN_FILE_OWN_KEYS and the paths it names, RUN_FILE_PATH_KEYS). ConfigError for anything else.

    Args:
        path: the JSON file or run file.

    Returns:
        Flag name -> value, as the file holds them (types not checked yet).
    """
    return _read_config(path)[0]


def _read_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(read_config's flags, the paths a run file named that were dropped: key -> its value)."""
    from relaympi.results.schema import HDF5_SIGNATURE

    try:
        with path.open("rb") as file:
            raw = file.read()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from exc
    own: tuple[str, ...] = ()
    if raw.startswith(HDF5_SIGNATURE):
        text, own = _run_file_config(path), RUN_FILE_OWN_KEYS
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(
                f"--config {path} is neither UTF-8 JSON nor a run file; it takes a JSON object of "
                "flags or a run file (.h5)"
            ) from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {path}: cannot read a JSON object: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a JSON object of flags")
    values = {key: value for key, value in values.items() if key not in own}
    dropped: dict[str, Any] = {}
    if own:  # a run file: its own files were left out above, the other paths it names go here
        for key in RUN_FILE_PATH_KEYS:
            if values.get(key) is not None:
                dropped[key] = values.pop(key)
        topology = values.get("topology")
        if isinstance(topology, str) and EDGE_LIST_PREFIX in topology:
            dropped["topology"] = values.pop("topology")
    return values, dropped


def _warn_dropped(config: Path, dropped: dict[str, Any]) -> None:
    """One warning line (rank 0) naming each path a run file's config held and the rerun dropped;
    the values are quoted as JSON, so a planted one cannot add lines or terminal escapes."""
    if not dropped or launch().rank != 0:
        return
    flags = {f.name: flag for f, flag in run_config.FLAGS}
    named = ", ".join(f"{flags[k].option_string(k)} {json.dumps(v)}" for k, v in dropped.items())
    print(
        f"warning: --config {json.dumps(str(config))}: the run file's paths are not taken (a run "
        f"file names files of its author's choosing; give them on the command line): {named}",
        file=sys.stderr,
    )


def _run_file_config(path: Path) -> str:
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as file:
            text = file.attrs.get("config")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read the HDF5 file: {exc}") from exc
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ConfigError(f"--config {path} is an HDF5 file without a run's `config` attribute")
    return text


def _kind(name: str, flag: Flag) -> tuple[str, Callable[[Any], bool]]:
    """What a config key takes in JSON: (its words, whether a non-null value is one)."""
    number = (int, float)
    if flag.switch or flag.negatable:
        return "true or false", lambda v: isinstance(v, bool)
    if flag.choices:
        choices = tuple(flag.choices())
        return f"one of {', '.join(choices)}", lambda v: isinstance(v, str)
    if flag.type is int:
        return "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)
    if flag.type is float:
        return "a number", lambda v: isinstance(v, number) and not isinstance(v, bool)
    if name == "milestones":
        return (
            "a list of numbers (epochs)",
            lambda v: (
                isinstance(v, list)
                and all(isinstance(m, number) and not isinstance(m, bool) for m in v)
            ),
        )
    return "a string", lambda v: isinstance(v, str)


def checked_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    """``values`` (from ``source``, a --config file) with each known key's JSON type checked
    against its flag: a ConfigError names the first bad key, its value and what it takes (numbers
    written as strings included). Float flags' integers become floats, as the command line parses
    them; unknown keys are left to RunConfig.from_dict."""
    fields = {f.name: (f, flag) for f, flag in run_config.FLAGS}
    checked = dict(values)
    for key, value in values.items():
        if key == "extra" and not isinstance(value, dict):
            raise ConfigError(f'{source}: "extra" is {json.dumps(value)}; it takes a JSON object')
        if key not in fields:
            continue
        f, flag = fields[key]
        words, fits = _kind(key, flag)
        nullable = "None" in str(f.type)
        if value is None and nullable:
            continue
        if value is None or not fits(value):
            hint = ""
            if isinstance(value, str) and flag.type in (int, float) and _is_number(value):
                hint = f" (write {value} without quotes)"
            takes = words + (" or null" if nullable else "")
            raise ConfigError(
                f"{source}: {json.dumps(key)} is {json.dumps(value)}; it takes {takes}{hint}"
            )
        if flag.type is float:
            checked[key] = float(value)
    return checked


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

"""The command line of `python -m relaympi.data`: fetch, check, prepare-imagenet."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import urllib.parse
from pathlib import Path

from relaympi.data.download import DataError
from relaympi.data.manifest import UNVERIFIED, VERIFIED
from relaympi.data.paths import MIRROR_ENV, ROOT_ENV, data_root, fetch_command, fix_command
from relaympi.entrypoint import UsageParser

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_EPILOG = f"""\
The data root is --root, else ${ROOT_ENV}, else ~/.cache/relaympi; each set lives in
<root>/<name>/, where `python -m relaympi.train --task T` finds it without --data-dir.

  python -m relaympi.data fetch cifar10             # CIFAR-10 binary version, md5-checked
  python -m relaympi.data fetch agnews distilbert   # AG News CSVs and the DistilBERT model
  python -m relaympi.data check                     # what is there, verified or not
  python -m relaympi.data prepare-imagenet --train ILSVRC2012_img_train.tar \\
      --val ILSVRC2012_img_val.tar --devkit ILSVRC2012_devkit_t12.tar.gz

On a cluster, fetch on the login node (it has internet) into a root the compute nodes
see, then submit. A site mirror: --url URL or ${MIRROR_ENV} (files at $MIRROR/<name>/<file>).
Exit status: 0 done, 1 failed (offline, bad checksum; check: a named set is not verified), 2 misuse.
"""


def build_parser() -> argparse.ArgumentParser:
    # relaympi.data.sets and the task modules are imported where a subcommand needs them, so that
    # `--help` and a usage error answer at once
    from relaympi.data.sets import DATASETS, FETCHABLE

    p = UsageParser(
        prog="python -m relaympi.data",
        description="Fetch, check and prepare the data sets of relaympi's tasks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    root_help = f"data root (default ${ROOT_ENV}, else ~/.cache/relaympi)"

    fetch = sub.add_parser("fetch", help="download, verify and lay out public data sets")
    fetch.add_argument(
        "names",
        nargs="+",
        type=_fetchable,
        metavar="NAME",
        help=f"one or more of {', '.join(FETCHABLE)}",
    )
    fetch.add_argument("--root", type=Path, help=root_help)
    fetch.add_argument(
        "--url",
        help="base URL of a mirror holding the set's files by name (default "
        f"${MIRROR_ENV}/<name>, else the official source)",
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars")

    check = sub.add_parser(
        "check", help="say what is present, complete and verified under the root"
    )
    check.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"tasks or sets: {', '.join(DATASETS)} (default: all)",
    )
    check.add_argument("--root", type=Path, help=root_help)
    check.add_argument(
        "--quick", action="store_true", help="compare file sizes only, not checksums"
    )

    prep = sub.add_parser(
        "prepare-imagenet", help="lay out ILSVRC2012 as class folders under <root>/imagenet"
    )
    prep.add_argument(
        "--train",
        type=Path,
        required=True,
        help="ILSVRC2012_img_train.tar, or a folder of its per-class tars or class folders",
    )
    prep.add_argument(
        "--val",
        type=Path,
        required=True,
        help="ILSVRC2012_img_val.tar, or the folder of its flat validation images",
    )
    prep.add_argument(
        "--devkit",
        type=Path,
        required=True,
        help="ILSVRC2012_devkit_t12.tar.gz (or its folder), or Kaggle's LOC_val_solution.csv",
    )
    prep.add_argument("--root", type=Path, help=root_help)
    how = prep.add_mutually_exclusive_group()
    how.add_argument(
        "--link",
        action="store_true",
        help="hard-link images from folder sources instead of copying them",
    )
    how.add_argument(
        "--move",
        action="store_true",
        help="move images from folder sources instead of copying them",
    )
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _fetchable(name: str) -> str:
    """A name `fetch` accepts (the sets it can download); ImageNet gets the command that prepares
    it."""
    from relaympi.data.sets import FETCHABLE

    if name == "imagenet":
        raise argparse.ArgumentTypeError(
            "ImageNet cannot be fetched (its licence needs an account at image-net.org); "
            f"download the tars there, then: {fetch_command('imagenet')}"
        )
    if name not in FETCHABLE:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {name!r} (choose from {', '.join(FETCHABLE)})"
        )
    return name


_URL_SCHEMES = ("http", "https", "ftp", "file")  # what urllib downloads from


def check_mirror_url(url: str, source: str) -> None:
    """ValueError unless ``url`` (given as ``source``: --url or the mirror variable) is a URL urllib
    fetches."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _URL_SCHEMES or (parts.scheme != "file" and not parts.netloc):
        raise ValueError(
            f"{source} {url!r} is not a mirror URL; give http(s)://HOST/PATH, ftp://HOST/PATH "
            "or file:///PATH (a folder holding the set's files by name)"
        )


def check_names(names: list[str]) -> list[str]:
    """Data set names for tasks or set names (agnews brings distilbert with it); ValueError if
    unknown."""
    from relaympi.data.paths import task_sets
    from relaympi.data.sets import DATASETS
    from relaympi.tasks import TASK_NAMES

    result: list[str] = []
    for name in names or list(DATASETS):
        sets = task_sets(name) or ((name,) if name in DATASETS else ())
        if not sets and name in TASK_NAMES:
            continue  # digits, quadratics: nothing to fetch
        if not sets:
            raise ValueError(
                f"unknown data set or task {name!r}; choose from {', '.join(DATASETS)}"
            )
        result.extend(s for s in sets if s not in result)
    return result


def cmd_check(names: list[str], root: Path | None, quick: bool, strict: bool) -> int:
    """Print each set's state; with ``strict`` (names given), exit 1 unless all are verified."""
    from relaympi.data.sets import DATASETS

    shown_root = None if root is None else data_root(root)  # commands name --root only if given
    root = data_root(root)
    print(f"data root: {root}")
    bad = 0
    for name in names:
        status = DATASETS[name].status(root, hashes=not quick)
        line = f"  {name:11s} {status.state:10s} {status.path}"
        if status.detail:
            line += f"  ({status.detail})"
        print(line)
        if status.state != VERIFIED:
            bad += 1
            fix = fix_command(name, status.path, shown_root)
            if status.state == UNVERIFIED:
                fix = f"usable as it is (complete); to have it verified: {fix}"
            print(f"  {'':11s} -> {fix}")
    return EXIT_FAILED if bad and strict else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "fetch":
            from relaympi.data.sets import DATASETS, FetchableSet

            try:
                if args.url is not None:
                    check_mirror_url(args.url, "--url")
                elif os.environ.get(MIRROR_ENV):
                    check_mirror_url(os.environ[MIRROR_ENV], f"${MIRROR_ENV}")
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return EXIT_USAGE
            for name in dict.fromkeys(args.names):
                dataset = DATASETS[name]
                assert isinstance(dataset, FetchableSet)  # the parser takes FETCHABLE names only
                dataset.fetch(args.root, url=args.url, progress=not args.no_progress)
            return EXIT_OK
        if args.command == "check":
            try:
                names = check_names(args.names)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return EXIT_USAGE
            return cmd_check(names, args.root, args.quick, strict=bool(args.names))
        from relaympi.data.imagenet import UsageError, prepare_imagenet

        try:
            prepare_imagenet(
                args.train,
                args.val,
                args.devkit,
                data_root(args.root),
                mode="link" if args.link else "move" if args.move else "copy",
                progress=not args.no_progress,
            )
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return EXIT_OK
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # `... | head`: the reader left; entrypoint.run ends quietly
        raise
    except OSError as exc:  # an unwritable root, a full disk
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted: partial files stay under the root; rerun to resume", file=sys.stderr)
        return 130

"""Where data sets live: the data root and each task's folders under it (no heavy imports)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

ROOT_ENV = "RELAYMPI_DATA"  # the data root, when --data-dir / --root is not given
MIRROR_ENV = "RELAYMPI_DATA_MIRROR"  # base URL of a site's mirror: $MIRROR/<set>/<file>
DEFAULT_ROOT = Path("~/.cache/relaympi")

# task -> the data set it reads from --data-dir, and the one it reads from --model-dir
TASK_DATA = {"cifar10": "cifar10", "imagenet": "imagenet", "agnews": "agnews"}
TASK_MODEL = {"agnews": "distilbert"}


def data_root(root: Path | str | None = None) -> Path:
    """``root`` if given, else ``$RELAYMPI_DATA``, else ``~/.cache/relaympi``; absolute."""
    if root is None or str(root) == "":
        root = os.environ.get(ROOT_ENV) or DEFAULT_ROOT
    return Path(root).expanduser().absolute()


def set_dir(name: str, root: Path | str | None = None) -> Path:
    """The folder of data set ``name`` (cifar10, imagenet, agnews, distilbert) under the root."""
    return data_root(root) / name


def task_sets(task: str) -> tuple[str, ...]:
    """The data sets a training task reads (empty for digits and quadratics)."""
    return tuple(s for s in (TASK_DATA.get(task), TASK_MODEL.get(task)) if s)


def task_dirs(task: str, root: Path | str | None = None) -> tuple[Path | None, Path | None]:
    """(data dir, model dir) a task reads by default: ``<root>/<task>`` and
    ``<root>/distilbert``."""
    data = TASK_DATA.get(task)
    model = TASK_MODEL.get(task)
    return (
        set_dir(data, root) if data else None,
        set_dir(model, root) if model else None,
    )


def fetch_command(name: str, root: Path | None = None) -> str:
    """The command that puts data set ``name`` under ``root`` (ImageNet: the prepare step);
    without ``root``, under the default root of the shell it runs in."""
    where = f" --root {shlex.quote(str(root))}" if root is not None else ""
    if name == "imagenet":
        return (
            f"python -m relaympi.data prepare-imagenet --train ILSVRC2012_img_train.tar "
            f"--val ILSVRC2012_img_val.tar --devkit ILSVRC2012_devkit_t12.tar.gz{where}"
        )
    return f"python -m relaympi.data fetch {name}{where}"


def fix_command(name: str, directory: Path, root: Path | None = None) -> str:
    """The command that leaves data set ``name`` verified in ``directory`` (``<root>/<name>``):
    fetch it (ImageNet: prepare it). Fetch replaces only a copy it wrote itself (one with a
    manifest), and prepare-imagenet none, so any other folder there is first moved aside (kept,
    never deleted): following the command works, instead of being refused by it."""
    from relaympi.data import manifest

    command = fetch_command(name, root)
    if not directory.exists() or (name != "imagenet" and manifest.read(directory) is not None):
        return command
    aside = directory.with_name(f"{directory.name}.by-hand")
    number = 2
    while aside.exists():
        aside = directory.with_name(f"{directory.name}.by-hand-{number}")
        number += 1
    return f"mv {shlex.quote(str(directory))} {shlex.quote(str(aside))} && {command}"


def fetch_hint(name: str, directory: Path | str | None = None) -> str:
    """A sentence naming the command that puts data set ``name`` where a task looked for it."""
    if directory is not None and Path(directory).name == name:
        directory = Path(directory).expanduser().absolute()
        root = directory.parent
        return (
            f"Get it with `{fix_command(name, directory, None if root == data_root() else root)}`."
        )
    return (
        f"Get it with `{fetch_command(name)}` (into {data_root()}, where relaympi.train "
        "looks when no --data-dir/--model-dir is given)."
    )

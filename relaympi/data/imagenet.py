"""`prepare-imagenet`: ILSVRC2012's official tars laid out as ``train/<wnid>/`` and ``val/<wnid>/``.

The training tar holds one tar per class (``n01440764.tar`` ...); the validation tar holds
50,000 flat images ``ILSVRC2012_val_00000001.JPEG`` ... whose classes are in the devkit:
``data/ILSVRC2012_validation_ground_truth.txt`` (line i: the ILSVRC2012_ID of image i, 1-based)
and ``data/meta.mat`` (the ``synsets`` struct: ILSVRC2012_ID -> WNID for the 1000 leaf classes),
or in Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString`` whose first word is the
wnid). Any subset of classes or images is accepted and reported; validation images of classes
without training images are left out (the task's classes are its training folders).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import shutil
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from relaympi.data import manifest
from relaympi.data.download import DataError
from relaympi.data.layouts import count_images, is_image

log = logging.getLogger("relaympi.data")

FULL_TRAIN_IMAGES = 1_281_167
FULL_VAL_IMAGES = 50_000
FULL_CLASSES = 1000
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
META = "meta.mat"
_WNID = re.compile(r"^n\d{8}$")


class UsageError(ValueError):
    """A bad argument (a path that is not there, an unknown devkit format); exit status 2."""


@dataclass
class _Image:
    """One image to place: its file name, and where its bytes come from (a path or a tar member)."""

    name: str
    path: Path | None = None
    read: IO[bytes] | None = None


def prepare_imagenet(
    train: Path, val: Path, devkit: Path, root: Path, mode: str = "copy", progress: bool = True
) -> Path:
    """Lay out ``<root>/imagenet`` from the official files; returns that folder.

    ``mode`` says what happens to images that come as files (folder sources): ``copy``, ``link``
    (hard links, same file system) or ``move``; images inside tars are extracted. Work happens in
    ``<root>/.imagenet.partial`` (a rerun continues there), renamed into place once the counts are
    verified and the manifest is written.
    """
    if mode not in ("copy", "link", "move"):
        raise ValueError(f"mode must be copy, link or move, got {mode!r}")
    for flag, path in (("--train", train), ("--val", val), ("--devkit", devkit)):
        if not path.exists():
            raise UsageError(f"{flag} {path} does not exist")
    target = root / "imagenet"
    if manifest.read(target) is not None:
        log.info(
            "imagenet: already prepared in %s (see `python -m relaympi.data check imagenet`)",
            target,
        )
        return target
    if target.exists():
        raise DataError(
            f"{target} exists but was not written by prepare-imagenet: move it away and rerun"
        )
    labels = read_val_labels(devkit)
    staging = root / ".imagenet.partial"
    (staging / "train").mkdir(parents=True, exist_ok=True)
    (staging / "val").mkdir(parents=True, exist_ok=True)
    placer = _Placer(mode, progress)
    try:
        for wnid, images in _train_classes(train):
            placer.place_all(images, staging / "train" / wnid)
        classes = {p.name for p in (staging / "train").iterdir() if p.is_dir()}
        if not classes:
            raise DataError(
                f"--train {train}: no class tars (n*.tar) or class folders (n*/) with images"
            )
        skipped = _place_val(val, labels, classes, staging / "val", placer)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise DataError(
            f"cannot read the archives ({exc}): a truncated or damaged download? What was unpacked "
            f"stays in {staging}; a rerun continues there"
        ) from exc
    finally:
        placer.close()
    counts = {
        "train": count_images(staging / "train"),
        "val": count_images(staging / "val"),
        "classes": len(classes),
    }
    for split in ("train", "val"):
        if counts[split] < placer.placed[split]:
            raise DataError(
                f"{staging / split} holds {counts[split]} images after placing "
                f"{placer.placed[split]}; "
                "something removed files while preparing"
            )
    if counts["classes"] == FULL_CLASSES and counts["train"] != FULL_TRAIN_IMAGES:
        log.warning(
            "all %d classes but %d training images (the full set has %d): a truncated tar?",
            FULL_CLASSES,
            counts["train"],
            FULL_TRAIN_IMAGES,
        )
    if counts["classes"] == FULL_CLASSES and counts["val"] != FULL_VAL_IMAGES:
        log.warning(
            "all %d classes but %d validation images (the full set has %d)",
            FULL_CLASSES,
            counts["val"],
            FULL_VAL_IMAGES,
        )
    full = (counts["train"], counts["val"], counts["classes"]) == (
        FULL_TRAIN_IMAGES,
        FULL_VAL_IMAGES,
        FULL_CLASSES,
    )
    coverage = (
        "the full ILSVRC2012 set"
        if full
        else (
            f"a subset: the full set has {FULL_TRAIN_IMAGES:,} train / "
            f"{FULL_VAL_IMAGES:,} val images "
            f"in {FULL_CLASSES} classes"
        )
    )
    manifest.write(
        staging,
        "imagenet",
        f"train {train}; val {val}; devkit {devkit}",
        counts=counts,
        coverage=coverage,
        val_skipped=skipped,
        mode=mode,
    )
    os.rename(staging, target)
    log.info(
        "imagenet: %d train / %d val images in %d classes in %s: %s%s",
        counts["train"],
        counts["val"],
        counts["classes"],
        target,
        coverage,
        f"; left out {skipped} validation images of classes without training images"
        if skipped
        else "",
    )
    return target


# -- ground truth ----------------------------------------------------------------------------


def read_val_labels(devkit: Path) -> dict[str, str]:
    """Validation image stem (``ILSVRC2012_val_00000001``) -> wnid, from a devkit or LOC csv."""
    if devkit.is_file() and devkit.name.lower().endswith(".csv"):
        return _labels_from_loc_csv(devkit)
    if devkit.is_dir():
        found = {
            name: next(iter(sorted(devkit.rglob(name))), None) for name in (GROUND_TRUTH, META)
        }
        ground_truth, meta = found[GROUND_TRUTH], found[META]
        if ground_truth is None or meta is None:
            csvs = sorted(devkit.rglob("LOC_val_solution.csv"))
            if csvs:
                return _labels_from_loc_csv(csvs[0])
            raise UsageError(f"--devkit {devkit}: no data/{GROUND_TRUTH} and data/{META} inside")
        return _labels_from_devkit(ground_truth.read_bytes(), meta.read_bytes(), devkit)
    if devkit.is_file() and tarfile.is_tarfile(devkit):
        blobs: dict[str, bytes] = {}
        with tarfile.open(devkit) as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in (GROUND_TRUTH, META):
                    blobs[base] = tar.extractfile(member).read()  # type: ignore[union-attr]
        if len(blobs) < 2:
            raise UsageError(
                f"--devkit {devkit}: expecting data/{GROUND_TRUTH} and data/{META} in the archive"
            )
        return _labels_from_devkit(blobs[GROUND_TRUTH], blobs[META], devkit)
    raise UsageError(
        f"--devkit {devkit}: expecting ILSVRC2012_devkit_t12.tar.gz, its unpacked folder, "
        "or LOC_val_solution.csv"
    )


def _labels_from_devkit(ground_truth: bytes, meta: bytes, source: Path) -> dict[str, str]:
    try:
        import scipy.io
    except ImportError:
        raise DataError(
            f"reading {META} from {source} needs scipy (pip install scipy); or pass Kaggle's "
            "LOC_val_solution.csv as --devkit"
        ) from None
    try:
        synsets = scipy.io.loadmat(io.BytesIO(meta), squeeze_me=True)["synsets"]
        ids = [int(i) for i in synsets["ILSVRC2012_ID"]]
        wnids = [str(w) for w in synsets["WNID"]]
        leaves = [int(c) == 0 for c in synsets["num_children"]]
    except (KeyError, ValueError, TypeError, OSError) as exc:
        raise DataError(
            f"{source}: {META} is not the ILSVRC2012 devkit's synsets table ({exc})"
        ) from exc
    wnid_of = {i: w for i, w, leaf in zip(ids, wnids, leaves, strict=True) if leaf}
    labels: dict[str, str] = {}
    for number, line in enumerate(ground_truth.decode(errors="replace").split(), start=1):
        class_id = int(line) if line.isdigit() else -1
        if class_id not in wnid_of:
            raise DataError(
                f"{source}: {GROUND_TRUTH} line {number} names class {class_id}, not in {META}"
            )
        labels[f"ILSVRC2012_val_{number:08d}"] = wnid_of[class_id]
    return labels


def _labels_from_loc_csv(path: Path) -> dict[str, str]:
    labels: dict[str, str] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                labels[row["ImageId"]] = row["PredictionString"].split()[0]
            except (KeyError, IndexError, AttributeError):
                raise DataError(
                    f"{path}: expecting rows ImageId,PredictionString ('n01751748 x y w h ...')"
                ) from None
    if not labels:
        raise DataError(f"{path} holds no rows")
    return labels


# -- sources ---------------------------------------------------------------------------------


def _train_classes(train: Path) -> Iterator[tuple[str, Iterator[_Image]]]:
    """(wnid, images) per class, from the training tar, a folder of class tars, or class folders."""
    if train.is_file():
        with tarfile.open(train, "r|*") as outer:  # streamed: the 138 GB tar is read once
            for member in outer:
                wnid = member.name.rsplit("/", 1)[-1].removesuffix(".tar")
                if member.isfile() and member.name.endswith(".tar") and _WNID.match(wnid):
                    yield wnid, _tar_images(outer.extractfile(member))  # type: ignore[arg-type]
        return
    for entry in sorted(train.iterdir()):
        wnid = entry.name.removesuffix(".tar")
        if not _WNID.match(wnid):
            continue
        if entry.is_file() and entry.name.endswith(".tar"):
            with open(entry, "rb") as f:
                yield wnid, _tar_images(f)
        elif entry.is_dir():
            yield (
                wnid,
                (
                    _Image(p.name, path=p)
                    for p in sorted(entry.iterdir())
                    if p.is_file() and is_image(p.name)
                ),
            )


def _tar_images(fileobj: IO[bytes]) -> Iterator[_Image]:
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if member.isfile() and is_image(name):
                yield _Image(name, read=tar.extractfile(member))


def _val_images(val: Path) -> Iterator[tuple[str | None, _Image]]:
    """(wnid if the source already says it, image): flat tar or folder, or val/<wnid>/ folders."""
    if val.is_file():
        with tarfile.open(val, "r|*") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and is_image(name):
                    yield None, _Image(name, read=tar.extractfile(member))
        return
    for path in sorted(val.iterdir()):
        if path.is_file() and is_image(path.name):
            yield None, _Image(path.name, path=path)
        elif path.is_dir() and _WNID.match(path.name):  # already sorted into class folders
            for image in sorted(path.iterdir()):
                if image.is_file() and is_image(image.name):
                    yield path.name, _Image(image.name, path=image)


def _place_val(
    val: Path, labels: dict[str, str], classes: set[str], out: Path, placer: _Placer
) -> int:
    """Sort the flat validation images into ``out/<wnid>/``; returns how many were left out."""
    skipped = 0
    seen = 0
    unknown: list[str] = []
    for sorted_as, image in _val_images(val):
        seen += 1
        wnid = labels.get(image.name.rsplit(".", 1)[0], sorted_as)
        if wnid is None:
            unknown.append(image.name)
            continue
        if wnid not in classes:
            skipped += 1
            continue
        placer.place(image, out / wnid, "val")
    if not seen:
        raise DataError(f"--val {val}: no validation images (*.JPEG) in it")
    if unknown:
        raise DataError(
            f"{len(unknown)} validation images have no ground-truth entry (first: {unknown[0]}); "
            "is --devkit the ILSVRC2012 one?"
        )
    return skipped


class _Placer:
    """Writes images into class folders: extracted from tars, or copied / linked / moved."""

    def __init__(self, mode: str, progress: bool):
        from tqdm import tqdm

        self.mode = mode
        self.placed = {"train": 0, "val": 0}
        self.bar = tqdm(unit=" images", desc="imagenet", disable=not progress)

    def place_all(self, images: Iterator[_Image], folder: Path) -> None:
        for image in images:
            self.place(image, folder, "train")

    def place(self, image: _Image, folder: Path, split: str) -> None:
        folder.mkdir(exist_ok=True)
        dest = folder / image.name
        if image.read is not None:
            tmp = dest.with_name(dest.name + ".part")
            with open(tmp, "wb") as f:
                shutil.copyfileobj(image.read, f)
            os.replace(tmp, dest)
        elif not dest.exists():
            assert image.path is not None
            if self.mode == "link":
                try:
                    os.link(image.path, dest)
                except OSError as exc:
                    raise DataError(
                        f"cannot hard-link {image.path} to {dest} ({exc.strerror}): hard "
                        "links need one "
                        "file system; use --move, or neither flag to copy"
                    ) from None
            elif self.mode == "move":
                shutil.move(image.path, dest)
            else:
                shutil.copyfile(image.path, dest)
        self.placed[split] += 1
        self.bar.update()

    def close(self) -> None:
        self.bar.close()

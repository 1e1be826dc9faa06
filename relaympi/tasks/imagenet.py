"""ImageNet (class-folder JPEGs) with ResNet-20-EvoNorm, decoded by prefetching worker processes."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import nn

from relaympi.data.paths import fetch_hint
from relaympi.tasks.base import ClassificationTask, TaskDefaults, TaskError, TaskOptions
from relaympi.tasks.defaults import IMAGENET
from relaympi.tasks.evonorm import resnet20_evonorm

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_CROP_SCALE = (0.08, 1.0)  # area fraction of RandomResizedCrop
_CROP_RATIO = (3 / 4, 4 / 3)  # aspect ratio range of RandomResizedCrop
_CROP_TRIES = 10
_LAYOUT = "DIR/train/<wnid>/*.JPEG and DIR/val/<wnid>/*.JPEG (class folders; .jpeg/.jpg/.png)"


def random_resized_crop_box(
    width: int, height: int, rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(left, top, crop_width, crop_height) of an Inception-style random crop.

    Up to 10 tries at an area fraction in [0.08, 1] and a log-uniform aspect ratio in
    [3/4, 4/3]; if none fits, the largest centred crop whose aspect ratio is in range.
    """
    area = width * height
    log_low, log_high = math.log(_CROP_RATIO[0]), math.log(_CROP_RATIO[1])
    for _ in range(_CROP_TRIES):
        target_area = area * rng.uniform(*_CROP_SCALE)
        aspect = math.exp(rng.uniform(log_low, log_high))
        crop_w = round(math.sqrt(target_area * aspect))
        crop_h = round(math.sqrt(target_area / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return left, top, crop_w, crop_h
    aspect = width / height
    if aspect < _CROP_RATIO[0]:
        crop_w, crop_h = width, round(width / _CROP_RATIO[0])
    elif aspect > _CROP_RATIO[1]:
        crop_w, crop_h = round(height * _CROP_RATIO[1]), height
    else:
        crop_w, crop_h = width, height
    return (width - crop_w) // 2, (height - crop_h) // 2, crop_w, crop_h


def _open_rgb(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise TaskError(f"cannot decode image {path}: {exc}") from exc


def _to_chw(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def train_transform(image: Image.Image, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [3, size, size]: random resized crop, then horizontal flip with probability 1/2."""
    left, top, crop_w, crop_h = random_resized_crop_box(image.width, image.height, rng)
    box = (left, top, left + crop_w, top + crop_h)
    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_chw(out)


def eval_transform(image: Image.Image, size: int, resize: int) -> np.ndarray:
    """uint8 [3, size, size]: shorter side resized to ``resize``, then the centre ``size`` crop."""
    width, height = image.size
    if width <= height:
        new_size = (resize, int(resize * height / width))
    else:
        new_size = (int(resize * width / height), resize)
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BILINEAR)
    left = int(round((new_size[0] - size) / 2.0))
    top = int(round((new_size[1] - size) / 2.0))
    return _to_chw(image.crop((left, top, left + size, top + size)))


@dataclass(frozen=True)
class _Split:
    root: Path
    files: np.ndarray  # bytes paths relative to root (compact for 1.28M files)
    labels: np.ndarray  # int64

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.files[index]))


class _BatchDecoder(torch.utils.data.Dataset):
    """Decodes one whole batch per item, so DataLoader workers prefetch batches in order.

    Keys are ``("train", indices, rng)`` or ``("test", start, stop)``.
    """

    def __init__(self, train: _Split, test: _Split, size: int, resize: int):
        self.train, self.test, self.size, self.resize = train, test, size, resize

    def __len__(self) -> int:  # not used: keys come from the sampler
        return 0

    def __getitem__(self, key: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if key[0] == "train":
            _, indices, rng = key
            images = [
                train_transform(_open_rgb(self.train.path(int(i))), self.size, rng) for i in indices
            ]
            labels = self.train.labels[np.asarray(indices, dtype=np.int64)]
        else:
            _, start, stop = key
            images = [
                eval_transform(_open_rgb(self.test.path(i)), self.size, self.resize)
                for i in range(start, stop)
            ]
            labels = self.test.labels[start:stop]
        inputs = (
            torch.from_numpy(np.stack(images))
            if images
            else torch.empty(0, 3, self.size, self.size, dtype=torch.uint8)
        )
        return inputs, torch.from_numpy(np.array(labels, dtype=np.int64))


def _collate_identity(batch: Any) -> Any:
    return batch


class Normalize(nn.Module):
    """uint8 (or 0..255 float) images -> float, ImageNet mean/std normalized, on the model's device.

    Kept inside the model so that batches cross to the accelerator as uint8 (4x less traffic).
    """

    mean: torch.Tensor  # buffers, registered in __init__
    std: torch.Tensor

    def __init__(
        self, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD
    ):
        super().__init__()
        self.register_buffer("mean", 255.0 * torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", 255.0 * torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.mean.dtype) - self.mean) / self.std


def _list_images(directory: Path) -> list[str]:
    return sorted(
        entry.name
        for entry in os.scandir(directory)
        if entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS)
    )


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def _scan_split(split_dir: Path, class_index: dict[str, int], allow_empty: bool) -> _Split:
    files: list[bytes] = []
    labels: list[int] = []
    for wnid in _class_dirs(split_dir):
        if wnid not in class_index:
            raise TaskError(
                f"{split_dir / wnid}: class {wnid!r} is not among the {len(class_index)} "
                f"classes of {split_dir.parent / 'train'}"
            )
        names = _list_images(split_dir / wnid)
        if not names and not allow_empty:
            raise TaskError(f"{split_dir / wnid} holds no images (expected *.JPEG, *.jpg or *.png)")
        files.extend(os.fsencode(os.path.join(wnid, name)) for name in names)
        labels.extend([class_index[wnid]] * len(names))
    if not files:
        if _list_images(split_dir):
            raise TaskError(
                f"{split_dir} holds images directly, not in class folders; expected {_LAYOUT} "
                "(the official validation images come flat: move them into <wnid>/ folders)"
            )
        raise TaskError(f"{split_dir} holds no images; expected {_LAYOUT}")
    return _Split(split_dir, np.array(files, dtype=np.bytes_), np.array(labels, dtype=np.int64))


class ImageNetTask(ClassificationTask):
    """ImageNet classification with ResNet-20-EvoNorm (paper appendix, "ImageNet").

    Model: ResNet-20 (3 stages x 3 basic blocks, widths 16/32/64) with EvoNorm-S0 in place of
    BatchNorm, an ImageNet stem (7x7/2 conv + 3x3/2 max-pool: stages run at 56, 28, 14 for 224
    inputs) and a ``num_classes``-way classifier: 339,096 parameters for 1000 classes (the
    classifier holds 65,000 of them). Inputs are uint8 images; the model's first layer
    normalizes them with the ImageNet mean/std.

    Data: ``train/<wnid>/`` and ``val/<wnid>/`` under ``--data-dir``; class index = position
    of the wnid in sorted order of ``train/``. Training: random-resized crop to ``image_size``
    and random horizontal flip, drawn from the step's rng only. Evaluation: shorter side to
    ``resize_size``, centre ``image_size`` crop. Batches are decoded by
    ``options.num_loader_workers`` processes (0: in this process) with identical results.
    """

    name: ClassVar[str] = "imagenet"
    defaults: ClassVar[TaskDefaults] = IMAGENET
    image_size: ClassVar[int] = 224  # training crop and evaluation crop, pixels
    resize_size: ClassVar[int] = 256  # evaluation: shorter side before the centre crop

    @classmethod
    def check_data(cls, options: TaskOptions) -> None:
        cls._root(options)

    @staticmethod
    def _root(options: TaskOptions) -> Path:
        """--data-dir, once it holds the train and val folders (TaskError otherwise)."""
        if options.data_dir is None:
            raise TaskError(f"task imagenet needs --data-dir DIR with {_LAYOUT}")
        root = Path(options.data_dir)
        for split in ("train", "val"):
            if not (root / split).is_dir():
                hint = (
                    " (the official validation images come flat: move them into "
                    "val/<wnid>/ folders)"
                    if split == "val"
                    else ""
                )
                raise TaskError(
                    f"{root / split} is not a directory; expected {_LAYOUT}{hint}. "
                    f"{fetch_hint('imagenet', root)}"
                )
        return root

    def __init__(self, options: TaskOptions):
        super().__init__(options)
        if self.resize_size < self.image_size:
            raise ValueError(
                f"resize_size must be >= image_size, got {self.resize_size} < {self.image_size}"
            )
        root = self._root(options)
        self._classes = _class_dirs(root / "train")
        if not self._classes:
            raise TaskError(f"{root / 'train'} holds no class folders; expected {_LAYOUT}")
        class_index = {wnid: i for i, wnid in enumerate(self._classes)}
        self._train = _scan_split(root / "train", class_index, allow_empty=False)
        self._test = _scan_split(root / "val", class_index, allow_empty=True)
        self._decoder = _BatchDecoder(self._train, self._test, self.image_size, self.resize_size)

    @property
    def classes(self) -> list[str]:
        """The wnids, in class-index order."""
        return list(self._classes)

    @property
    def num_classes(self) -> int:
        return len(self._classes)

    @property
    def train_labels(self) -> np.ndarray:
        return self._train.labels

    @property
    def test_labels(self) -> np.ndarray:
        return self._test.labels

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Sequential(Normalize(), resnet20_evonorm(self.num_classes, stem="imagenet"))

    def train_batch(
        self, indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decoder[("train", np.asarray(indices), rng)]

    def train_batches(
        self, batch_indices: Iterable[np.ndarray], rngs: Iterable[np.random.Generator]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Prefetching version of ``train_batch`` over a stream; consumes (copies of) the rngs."""
        keys = (("train", np.asarray(i), rng) for i, rng in zip(batch_indices, rngs, strict=False))
        return self._load(keys)

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        count = len(self._test.labels)
        keys = (
            ("test", start, min(start + batch_size, count)) for start in range(0, count, batch_size)
        )
        return self._load(keys)

    def _load(self, keys: Iterable[tuple[Any, ...]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        workers = self.options.num_loader_workers
        if workers <= 0:
            return (self._decoder[key] for key in keys)
        pin = self.options.device.startswith("cuda") and torch.cuda.is_available()
        loader = torch.utils.data.DataLoader(
            self._decoder,
            batch_size=None,
            sampler=keys,
            num_workers=workers,
            collate_fn=_collate_identity,
            pin_memory=pin,
            prefetch_factor=4,
        )
        # Older torch versions pin tuples into lists; hand back (inputs, targets) tuples.
        return (tuple(batch) for batch in loader)

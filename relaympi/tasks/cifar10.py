"""CIFAR-10 with VGG-11 (no BatchNorm), read from the official binary or python files."""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaympi.data.paths import fetch_hint
from relaympi.tasks.base import ClassificationTask, TaskError, TaskOptions
from relaympi.tasks.defaults import CIFAR10
from relaympi.tasks.models import VGG11, parameter_bytes, seeded

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
PIXELS_PER_IMAGE = 3 * 32 * 32  # channel planes R, G, B, each 32x32 row-major
PADDING = 4  # random crop: zero-pad 4 pixels on each side, then crop 32x32
# Per-channel statistics used by the RelaySGD / quasi-global-momentum code bases.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)

BINARY_DIR = "cifar-10-batches-bin"
BINARY_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
BINARY_TEST = "test_batch.bin"
PYTHON_DIR = "cifar-10-batches-py"
PYTHON_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
PYTHON_TEST = "test_batch"
_RECORD_BYTES = 1 + PIXELS_PER_IMAGE  # binary version: label byte, then the pixels


class Cifar10Task(ClassificationTask):
    """CIFAR-10 classification with VGG-11, the paper's main deep-learning benchmark.

    Images stay in memory as uint8 tensors and are converted per batch: training batches
    are randomly cropped (4-pixel zero padding) and flipped with the step's numpy rng, then
    normalized per channel; test batches are only normalized.
    """

    name = "cifar10"
    defaults = CIFAR10

    def __init__(self, options: TaskOptions):
        super().__init__(options)
        (train_images, train_labels), (test_images, test_labels) = load_cifar10(options.data_dir)
        self._train_labels = train_labels
        self._train_images = torch.from_numpy(train_images)
        self._train_targets = torch.from_numpy(train_labels)
        self._test_images = torch.from_numpy(test_images)
        self._test_targets = torch.from_numpy(test_labels)

    @property
    def num_classes(self) -> int:
        return NUM_CLASSES

    @property
    def train_labels(self) -> np.ndarray:
        return self._train_labels

    @property
    def num_test(self) -> int:
        return len(self._test_targets)

    @property
    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images [n, *IMAGE_SHAPE], int64 targets [n]) of the training set, in index
        order: what ``train_batch`` crops, flips and normalizes (the batched engine does it on a
        device)."""
        return self._train_images, self._train_targets

    def build_model(self, seed: int) -> torch.nn.Module:
        return seeded(seed, lambda: VGG11(NUM_CLASSES)).to(self.options.device)

    @classmethod
    def check_data(cls, options: TaskOptions) -> None:
        find_cifar10(options.data_dir)

    @classmethod
    def model_bytes(cls, settled: dict[str, Any], problem: Any) -> int:
        return parameter_bytes(lambda: VGG11(NUM_CLASSES))

    def train_batch(
        self, indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        images = augment(self._train_images[index], rng)
        device = self.options.device
        return normalize(images.to(device)), self._train_targets[index].to(device)

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        device = self.options.device
        for start in range(0, len(self._test_targets), batch_size):
            images = self._test_images[start : start + batch_size].to(device)
            yield normalize(images), self._test_targets[start : start + batch_size].to(device)


# -- augmentation ---------------------------------------------------------------------


def draw_crop_flip(
    rng: np.random.Generator, batch_size: int, padding: int = PADDING
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top, left, flip) per image: crop offsets in [0, 2 * padding] and flip flags."""
    top = rng.integers(0, 2 * padding + 1, size=batch_size)
    left = rng.integers(0, 2 * padding + 1, size=batch_size)
    flip = rng.random(batch_size) < 0.5
    return top, left, flip


def crop_flip(
    images: torch.Tensor,
    top: np.ndarray | torch.Tensor,
    left: np.ndarray | torch.Tensor,
    flip: np.ndarray | torch.Tensor,
    padding: int = PADDING,
) -> torch.Tensor:
    """Zero-pad [B, C, H, W] images by ``padding``, crop HxW at (top, left), then mirror
    horizontally where ``flip`` (arrays or tensors; on a GPU pass them on the images' device
    to keep the host from waiting); output pixel (y, x) of image b is padded pixel
    (top[b] + y, left[b] + x), or (top[b] + y, left[b] + W - 1 - x) when flipped."""
    batch, channels, height, width = images.shape
    # index tensors where the images are: CPU indices into a GPU tensor would be copied (and wait)
    # per call
    device = images.device
    padded = images.new_zeros((batch, channels, height + 2 * padding, width + 2 * padding))
    padded[:, :, padding : padding + height, padding : padding + width] = images
    # [B, H]
    rows = torch.as_tensor(top, device=device)[:, None] + torch.arange(height, device=device)
    columns = torch.arange(width, device=device).expand(batch, width)
    columns = torch.where(torch.as_tensor(flip, device=device)[:, None], columns.flip(1), columns)
    columns = columns + torch.as_tensor(left, device=device)[:, None]  # [B, W]
    return padded[
        torch.arange(batch, device=device)[:, None, None, None],
        torch.arange(channels, device=device)[None, :, None, None],
        rows[:, None, :, None],
        columns[:, None, None, :],
    ]


def augment(images: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Random 32x32 crop with 4-pixel zero padding and random horizontal flip."""
    return crop_flip(images, *draw_crop_flip(rng, len(images)))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 with CIFAR-10's per-channel mean and std."""
    mean, std = _channel_stats(images.device)
    return (images.float() / 255.0 - mean) / std


@functools.cache
def _channel_stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached per device: a fresh host-to-device copy per batch would sync the stream.
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    return mean, std


# -- loading ----------------------------------------------------------------------------

Split = tuple[np.ndarray, np.ndarray]  # uint8 images [N, 3, 32, 32], int64 labels [N]


def load_cifar10(data_dir: Path | str | None) -> tuple[Split, Split]:
    """((train images, labels), (test images, labels)) from either official layout.

    Looks for the binary version (``cifar-10-batches-bin/*.bin``, or the ``.bin`` files
    directly in ``data_dir``), then the python version (``cifar-10-batches-py/``, or its
    files directly in ``data_dir``). Files may hold any whole number of records.
    """
    paths, read = find_cifar10(data_dir)
    train = [read(path) for path in paths[:-1]]
    images = np.concatenate([batch[0] for batch in train])
    labels = np.concatenate([batch[1] for batch in train])
    return (images, labels), read(paths[-1])


def find_cifar10(data_dir: Path | str | None) -> tuple[list[Path], Any]:
    """(the training batches' paths then the test batch's, their reader) of the first complete
    layout in ``data_dir`` (load_cifar10's order); TaskError naming what is missing."""
    if data_dir is None:
        raise TaskError(f"the cifar10 task needs --data-dir. {_where_to_get_it(None)}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise TaskError(
            f"CIFAR-10 data directory {data_dir} does not exist. {_where_to_get_it(data_dir)}"
        )
    layouts = [
        (data_dir / BINARY_DIR, BINARY_TRAIN, BINARY_TEST, read_binary_batch),
        (data_dir, BINARY_TRAIN, BINARY_TEST, read_binary_batch),
        (data_dir / PYTHON_DIR, PYTHON_TRAIN, PYTHON_TEST, read_python_batch),
        (data_dir, PYTHON_TRAIN, PYTHON_TEST, read_python_batch),
    ]
    for directory, train_names, test_name, read in layouts:
        paths = [directory / name for name in (*train_names, test_name)]
        if all(path.is_file() for path in paths):
            return paths, read
    raise TaskError(
        f"no complete CIFAR-10 copy in {data_dir}{_missing(layouts)}. {_where_to_get_it(data_dir)}"
    )


def _where_to_get_it(data_dir: Path | None) -> str:
    return (
        f"{fetch_hint('cifar10', data_dir)} "
        "Expected the binary version: cifar-10-batches-bin/data_batch_1.bin ... "
        "data_batch_5.bin and test_batch.bin (or these files directly in the data "
        "directory), or the python version: cifar-10-batches-py/data_batch_1 ... "
        f"data_batch_5 and test_batch. Download the 'CIFAR-10 binary version' or 'CIFAR-10 "
        f"python version' tarball from {CIFAR10_URL} and extract it into --data-dir."
    )


def _missing(layouts: list[tuple[Path, tuple[str, ...], str, Any]]) -> str:
    """': missing X, Y in DIR' for the partly present layout closest to complete, if any."""
    best: list[Path] = []
    best_found = 0
    for directory, train_names, test_name, _ in layouts:
        paths = [directory / name for name in (*train_names, test_name)]
        found = sum(path.is_file() for path in paths)
        if found > best_found:
            best_found, best = found, [path for path in paths if not path.is_file()]
    if not best:
        return ""
    return f" (missing {', '.join(path.name for path in best)} in {best[0].parent})"


def read_binary_batch(path: Path) -> Split:
    """Records of 1 label byte + 3072 pixel bytes (the 'CIFAR-10 binary version')."""
    raw = _read_bytes(path)
    if len(raw) == 0 or len(raw) % _RECORD_BYTES:
        raise TaskError(
            f"{path}: expecting a whole number of {_RECORD_BYTES}-byte CIFAR-10 records, "
            f"got {len(raw)} bytes (truncated or not a CIFAR-10 binary batch file)"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, _RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    images = records[:, 1:].reshape(-1, *IMAGE_SHAPE).copy()
    return images, _check_labels(labels, path)


def read_python_batch(path: Path) -> Split:
    """A pickled dict with b'data' (uint8 [N, 3072]) and b'labels' (the 'python version').

    Unpickled with an unpickler that only resolves the numpy globals an array needs, so
    a tampered file cannot run code.
    """
    raw = _read_bytes(path)
    try:
        batch = _RestrictedUnpickler(io.BytesIO(raw), path, encoding="bytes").load()
    except TaskError:
        raise
    except Exception as exc:  # pickle reports damage with many exception types
        raise TaskError(f"{path}: not a readable CIFAR-10 python batch file ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise TaskError(f"{path}: expecting a pickled dict, got {type(batch).__name__}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == PIXELS_PER_IMAGE
        and data.shape[0] > 0
    ):
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise TaskError(
            f"{path}: expecting b'data' as a uint8 array of shape [N, {PIXELS_PER_IMAGE}], "
            f"got {dtype} {shape}"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"{path}: expecting b'labels' as a list of integers ({exc})") from exc
    if labels.shape != (data.shape[0],):
        raise TaskError(
            f"{path}: expecting {data.shape[0]} labels (one per image), got shape {labels.shape}"
        )
    images = np.ascontiguousarray(data).reshape(-1, *IMAGE_SHAPE).copy()
    return images, _check_labels(labels, path)


def _read_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TaskError(f"cannot read CIFAR-10 file {path}: {exc}") from exc


def _check_labels(labels: np.ndarray, path: Path) -> np.ndarray:
    bad = (labels < 0) | (labels >= NUM_CLASSES)
    if bad.any():
        raise TaskError(
            f"{path}: expecting labels in 0..{NUM_CLASSES - 1}, got {labels[bad][0]} "
            f"at record {int(np.flatnonzero(bad)[0])}"
        )
    return labels


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # ndarray.__reduce__ names the reconstruct function; taking it from there avoids
    # importing the deprecated numpy.core alias under numpy 2.
    reconstruct = np.zeros(0).__reduce__()[0]
    return {
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals that a pickled numpy array needs; refuses the rest."""

    def __init__(self, file: Any, path: Path, **kwargs: Any):
        super().__init__(file, **kwargs)
        self._path = path
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if (module, name) == ("_codecs", "encode"):
            return self._latin1_encode
        raise TaskError(
            f"refusing to unpickle global {module}.{name} in {self._path}: a CIFAR-10 "
            "python batch file needs only numpy arrays and plain containers"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise TaskError(f"refusing to unpickle {self._path}: it uses persistent ids")

    def _latin1_encode(self, text: Any, encoding: Any = None) -> bytes:
        """_codecs.encode as Python 3 uses it to write bytes in protocol 2 (text, 'latin1'); nothing
        else."""
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise TaskError(
                f"refusing to unpickle {self._path}: it calls _codecs.encode with "
                f"({type(text).__name__}, {encoding!r}); only (str, 'latin1') encodes bytes"
            )
        return text.encode("latin-1")

"""Small CIFAR-10 copies in both official on-disk formats, for tests."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

LABEL_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


class Cifar10Arrays(NamedTuple):
    """What a factory wrote: uint8 images [N, 3, 32, 32] and int64 labels [N]."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def _random_batches(n_per_batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Six batches (5 train, 1 test) of random pixels; labels cycle through all classes."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(6):
        images = rng.integers(0, 256, size=(n_per_batch, 3, 32, 32), dtype=np.uint8)
        labels = rng.permutation(np.arange(n_per_batch) % 10).astype(np.int64)
        batches.append((images, labels))
    return batches


def _arrays(batches: list[tuple[np.ndarray, np.ndarray]]) -> Cifar10Arrays:
    return Cifar10Arrays(
        np.concatenate([images for images, _ in batches[:5]]),
        np.concatenate([labels for _, labels in batches[:5]]),
        batches[5][0],
        batches[5][1],
    )


def write_cifar10_binary(
    directory: Path | str, n_per_batch: int = 50, seed: int = 0, nested: bool = True
) -> Cifar10Arrays:
    """The 'CIFAR-10 binary version': data_batch_{1..5}.bin, test_batch.bin, each a run of
    records of 1 label byte + 1024 R, 1024 G, 1024 B bytes (rows of 32, top to bottom);
    in ``directory/cifar-10-batches-bin`` when ``nested``, else in ``directory``."""
    target = Path(directory) / "cifar-10-batches-bin" if nested else Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    batches = _random_batches(n_per_batch, seed)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name, (images, labels) in zip(names, batches, strict=True):
        records = np.concatenate(
            [labels.astype(np.uint8)[:, None], images.reshape(len(images), -1)], axis=1
        )
        (target / name).write_bytes(records.tobytes())
    (target / "batches.meta.txt").write_text("".join(f"{name}\n" for name in LABEL_NAMES))
    return _arrays(batches)


def write_cifar10_python(
    directory: Path | str, n_per_batch: int = 50, seed: int = 0, nested: bool = True
) -> Cifar10Arrays:
    """The 'CIFAR-10 python version': data_batch_{1..5}, test_batch, batches.meta, each a
    protocol-2 pickle as Python 2's cPickle wrote them (byte-string keys, b'data' a numpy
    uint8 array [N, 3072], b'labels' a list of ints); in ``directory/cifar-10-batches-py``
    when ``nested``, else in ``directory``."""
    target = Path(directory) / "cifar-10-batches-py" if nested else Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    batches = _random_batches(n_per_batch, seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    labels_of = [f"training batch {i} of 5" for i in range(1, 6)] + ["testing batch 1 of 1"]
    for name, batch_label, (images, labels) in zip(names, labels_of, batches, strict=True):
        content = {
            b"batch_label": batch_label.encode(),
            b"labels": [int(label) for label in labels],
            b"data": images.reshape(len(images), -1),
            b"filenames": [f"image_{name}_{i}.png".encode() for i in range(len(images))],
        }
        (target / name).write_bytes(py2_pickle(content))
    meta = {
        b"num_cases_per_batch": n_per_batch,
        b"label_names": [name.encode() for name in LABEL_NAMES],
        b"num_vis": 3072,
    }
    (target / "batches.meta").write_bytes(py2_pickle(meta))
    return _arrays(batches)


def py2_pickle(obj: object) -> bytes:
    """Pickle ``obj`` (dicts, lists, tuples, bytes, ints, bools, None, numpy arrays) with
    the opcodes Python 2's cPickle emits at protocol 2. Python 3 would encode bytes
    through ``_codecs.encode``, which the real files never reference."""
    out = bytearray(b"\x80\x02")  # PROTO 2
    _emit(obj, out)
    out += b"."  # STOP
    return bytes(out)


def _emit(obj: object, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif obj is True or obj is False:
        out += b"\x88" if obj else b"\x89"  # NEWTRUE / NEWFALSE
    elif isinstance(obj, int):
        if 0 <= obj < 256:
            out += b"K" + bytes([obj])  # BININT1
        elif 0 <= obj < 65536:
            out += b"M" + struct.pack("<H", obj)  # BININT2
        else:
            out += b"J" + struct.pack("<i", obj)  # BININT
    elif isinstance(obj, bytes):
        if len(obj) < 256:
            out += b"U" + bytes([len(obj)]) + obj  # SHORT_BINSTRING
        else:
            out += b"T" + struct.pack("<I", len(obj)) + obj  # BINSTRING
    elif isinstance(obj, tuple):
        if 1 <= len(obj) <= 3:
            for item in obj:
                _emit(item, out)
            out += (b"\x85", b"\x86", b"\x87")[len(obj) - 1]  # TUPLE1..3
        else:
            out += b"("  # MARK
            for item in obj:
                _emit(item, out)
            out += b"t"  # TUPLE
    elif isinstance(obj, list):
        out += b"]("  # EMPTY_LIST, MARK
        for item in obj:
            _emit(item, out)
        out += b"e"  # APPENDS
    elif isinstance(obj, dict):
        out += b"}("  # EMPTY_DICT, MARK
        for key, value in obj.items():
            _emit(key, out)
            _emit(value, out)
        out += b"u"  # SETITEMS
    elif isinstance(obj, np.ndarray):
        _emit_array(obj, out)
    else:
        raise TypeError(f"py2_pickle cannot write {type(obj).__name__}")


def _emit_array(array: np.ndarray, out: bytearray) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise TypeError("py2_pickle writes plain numeric arrays only")
    # _reconstruct(ndarray, (0,), 'b'), then BUILD with (version, shape, dtype, fortran, data)
    out += b"cnumpy.core.multiarray\n_reconstruct\n"
    out += b"cnumpy\nndarray\n"
    _emit((0,), out)
    _emit(b"b", out)
    out += b"\x87R"  # TUPLE3, REDUCE
    out += b"("  # MARK
    _emit(1, out)
    _emit(tuple(int(n) for n in array.shape), out)
    _emit_dtype(array.dtype, out)
    _emit(False, out)
    _emit(array.tobytes(), out)
    out += b"tb"  # TUPLE, BUILD


def _emit_dtype(dtype: np.dtype, out: bytearray) -> None:
    # dtype('u1', 0, 1) with state (3, '|', None, None, None, -1, -1, 0), as numpy pickles it.
    out += b"cnumpy\ndtype\n"
    _emit(f"{dtype.kind}{dtype.itemsize}".encode(), out)
    out += b"K\x00K\x01\x87R("  # 0, 1, TUPLE3, REDUCE, MARK
    byteorder = "|" if dtype.itemsize == 1 else "<"
    for item in (3, byteorder.encode(), None, None, None):
        _emit(item, out)
    out += b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"  # -1, -1, 0, TUPLE, BUILD

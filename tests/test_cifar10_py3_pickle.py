"""CIFAR-10 python batches re-pickled by Python 3 at protocol 2 (bytes via _codecs.encode) load;
_codecs.encode is allowed with exactly the latin-1 argument and nothing else."""

from __future__ import annotations

import codecs
import pickle

import numpy as np
import pytest

from relaympi.tasks import TaskError
from relaympi.tasks.cifar10 import read_python_batch


def _batch(n: int = 3) -> dict:
    rng = np.random.default_rng(0)
    return {
        b"batch_label": b"training batch 1 of 5",
        b"labels": [1, 2, 3][:n],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
    }


def test_python3_protocol2_repickle_loads(tmp_path) -> None:
    batch = _batch()
    raw = pickle.dumps(batch, protocol=2)
    assert b"_codecs" in raw  # Python 3 writes bytes at protocol 2 as _codecs.encode(str, 'latin1')
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    images, labels = read_python_batch(path)
    assert labels.tolist() == [1, 2, 3]
    assert np.array_equal(images.reshape(3, -1), batch[b"data"])


@pytest.mark.parametrize("args", [("abc", "rot13"), ("abc", "utf-8"), (b"abc", "latin1"), ("abc",)])
def test_codecs_encode_with_anything_but_latin1_is_refused(tmp_path, args) -> None:
    class Call:
        def __reduce__(self):
            return (codecs.encode, args)

    raw = pickle.dumps({b"data": Call()}, protocol=2)
    assert b"_codecs\nencode" in raw
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    with pytest.raises(TaskError, match="refusing to unpickle .*_codecs.encode"):
        read_python_batch(path)


def test_other_codecs_functions_are_still_refused(tmp_path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(b"\x80\x02c_codecs\ndecode\nX\x03\x00\x00\x00abcX\x06\x00\x00\x00latin1\x86R.")
    with pytest.raises(TaskError, match=r"refusing to unpickle global _codecs\.decode"):
        read_python_batch(path)

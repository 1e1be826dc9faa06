"""CIFAR-10 task: both file formats, safe unpickling, augmentation and VGG-11."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from relaympi.tasks import TaskError, TaskOptions, get_task_class
from relaympi.tasks.cifar10 import (
    MEAN,
    STD,
    Cifar10Task,
    augment,
    crop_flip,
    draw_crop_flip,
    load_cifar10,
    normalize,
)
from relaympi.tasks.models import VGG11, VGG11_NUM_PARAMETERS
from tests.data_factories import py2_pickle, write_cifar10_binary, write_cifar10_python

WRITERS = {"binary": write_cifar10_binary, "python": write_cifar10_python}
SUBDIRS = {"binary": "cifar-10-batches-bin", "python": "cifar-10-batches-py"}


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("fmt", ["binary", "python"])
def test_both_layouts_round_trip_exact_pixels_and_labels(tmp_path, fmt, nested):
    written = WRITERS[fmt](tmp_path, n_per_batch=20, seed=3, nested=nested)
    (train_x, train_y), (test_x, test_y) = load_cifar10(tmp_path)
    assert train_x.dtype == np.uint8 and train_x.shape == (100, 3, 32, 32)
    assert train_y.dtype == np.int64
    assert np.array_equal(train_x, written.train_images)
    assert np.array_equal(train_y, written.train_labels)
    assert np.array_equal(test_x, written.test_images)
    assert np.array_equal(test_y, written.test_labels)


def test_factories_write_the_official_record_layout(tmp_path):
    written = write_cifar10_binary(tmp_path, n_per_batch=2)
    raw = (tmp_path / "cifar-10-batches-bin" / "test_batch.bin").read_bytes()
    assert len(raw) == 2 * 3073
    assert raw[0] == written.test_labels[0]
    assert raw[1 + 1024 * 2 + 32 * 5 + 7] == written.test_images[0, 2, 5, 7]  # blue, row 5, col 7
    write_cifar10_python(tmp_path, n_per_batch=2)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")  # our own file: the stock unpickler is fine
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (2, 3072)
    assert isinstance(batch[b"labels"], list)


def test_task_uses_the_files(tmp_path):
    written = write_cifar10_python(tmp_path, n_per_batch=10, seed=1)
    cls = get_task_class("cifar10")
    assert issubclass(cls, Cifar10Task)
    task = cls(TaskOptions(data_dir=tmp_path))
    assert task.num_classes == 10 and task.num_test == 10
    assert np.array_equal(task.train_labels, written.train_labels)
    x, y = next(task.test_batches(256))
    assert torch.equal(x, normalize(torch.from_numpy(written.test_images)))
    assert y.tolist() == written.test_labels.tolist()
    assert [len(y) for _, y in task.test_batches(4)] == [4, 4, 2]


def _poison(marker) -> list[bytes]:
    """Pickles that would create ``marker`` if a stock unpickler loaded them."""

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    command = f"touch {marker}".encode()
    return [
        pickle.dumps(Exploit(), protocol=2),
        pickle.dumps({b"data": Exploit()}, protocol=4),
        b"\x80\x02cos\nsystem\nT" + struct.pack("<I", len(command)) + command + b"\x85R.",
        b"cbuiltins\neval\n(Vopen(%r, 'w')\ntR." % str(marker).encode(),
    ]


@pytest.mark.parametrize("variant", range(4))
def test_tampered_python_file_is_refused_without_running_anything(tmp_path, variant):
    write_cifar10_python(tmp_path, n_per_batch=4)
    marker = tmp_path / "pwned"
    target = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    target.write_bytes(_poison(marker)[variant])
    with pytest.raises(TaskError, match=r"refusing to unpickle global \w+\.\w+ in .*data_batch_3"):
        load_cifar10(tmp_path)
    assert not marker.exists()


def test_python_file_with_other_numpy_globals_is_refused(tmp_path):
    write_cifar10_python(tmp_path, n_per_batch=4)
    target = tmp_path / "cifar-10-batches-py" / "test_batch"
    target.write_bytes(b"\x80\x02cnumpy\nload\nU\x03abc\x85R.")
    with pytest.raises(TaskError, match="global numpy.load in .*test_batch"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("truncate", "not a readable CIFAR-10 python batch file"),
        ([1, 2, 3], "expecting a pickled dict, got list"),
        ({b"data": np.zeros((4, 3071), np.uint8), b"labels": [0] * 4}, r"shape \[N, 3072\]"),
        ({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0] * 3}, "expecting 4 labels"),
        (
            {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 10]},
            "labels in 0..9, got 10",
        ),
        ({b"labels": [0] * 4}, "expecting b'data'"),
    ],
)
def test_malformed_python_file_names_the_file(tmp_path, content, message):
    write_cifar10_python(tmp_path, n_per_batch=4)
    target = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    if content == "truncate":
        target.write_bytes(target.read_bytes()[:-200])
    else:
        target.write_bytes(py2_pickle(content))
    with pytest.raises(TaskError, match=f"data_batch_2.*{message}|{message}.*data_batch_2"):
        load_cifar10(tmp_path)


def test_truncated_binary_file_is_refused(tmp_path):
    write_cifar10_binary(tmp_path, n_per_batch=5)
    target = tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin"
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(TaskError, match=r"data_batch_2.bin: expecting a whole number of 3073-byte"):
        load_cifar10(tmp_path)


def test_binary_label_out_of_range_is_refused(tmp_path):
    write_cifar10_binary(tmp_path, n_per_batch=5)
    target = tmp_path / "cifar-10-batches-bin" / "test_batch.bin"
    raw = bytearray(target.read_bytes())
    raw[3073 * 2] = 12
    target.write_bytes(bytes(raw))
    with pytest.raises(
        TaskError, match="test_batch.bin: expecting labels in 0..9, got 12 at record 2"
    ):
        load_cifar10(tmp_path)


def test_missing_directory_lists_expected_files(tmp_path):
    for data_dir in (tmp_path / "nowhere", tmp_path, None):
        with pytest.raises(TaskError) as error:
            Cifar10Task(TaskOptions(data_dir=data_dir))
        message = str(error.value)
        for expected in (
            "cifar-10-batches-bin/data_batch_1.bin",
            "data_batch_5.bin",
            "test_batch.bin",
            "cifar-10-batches-py/data_batch_1",
            "https://www.cs.toronto.edu/~kriz/cifar.html",
            "--data-dir",
        ):
            assert expected in message


def test_missing_file_is_named(tmp_path):
    write_cifar10_binary(tmp_path, n_per_batch=2)
    (tmp_path / "cifar-10-batches-bin" / "test_batch.bin").unlink()
    with pytest.raises(TaskError, match=r"missing test_batch.bin in .*cifar-10-batches-bin"):
        load_cifar10(tmp_path)


# -- augmentation --------------------------------------------------------------------


def _image(batch: int = 1) -> torch.Tensor:
    values = np.arange(batch * 3 * 32 * 32) % 251 + 1  # no zeros: padding stays visible
    return torch.from_numpy(values.astype(np.uint8).reshape(batch, 3, 32, 32))


def test_crop_and_flip_match_the_padded_slice():
    image = _image()
    padded = np.pad(image.numpy(), ((0, 0), (0, 0), (4, 4), (4, 4)))
    cropped = crop_flip(image, np.array([1]), np.array([7]), np.array([False]))
    assert np.array_equal(cropped.numpy(), padded[:, :, 1:33, 7:39])
    flipped = crop_flip(image, np.array([1]), np.array([7]), np.array([True]))
    assert np.array_equal(flipped.numpy(), padded[:, :, 1:33, 7:39][..., ::-1])
    assert flipped[0, 0, 0, 0] == 0 and cropped[0, 0, 0, 0] == 0  # the zero border
    centre = crop_flip(image, np.array([4]), np.array([4]), np.array([False]))
    assert torch.equal(centre, image)


def test_crop_flip_is_per_image():
    images = _image(batch=3)
    top, left, flip = np.array([0, 8, 4]), np.array([8, 0, 3]), np.array([True, False, True])
    out = crop_flip(images, top, left, flip)
    for b in range(3):
        one = crop_flip(images[b : b + 1], top[b : b + 1], left[b : b + 1], flip[b : b + 1])
        assert torch.equal(out[b : b + 1], one)


def test_augment_is_deterministic_given_the_rng():
    images = _image(batch=16)
    first = augment(images, np.random.default_rng(5))
    again = augment(images, np.random.default_rng(5))
    other = augment(images, np.random.default_rng(6))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    expected = crop_flip(images, *draw_crop_flip(np.random.default_rng(5), 16))
    assert torch.equal(first, expected)


def test_draws_cover_all_offsets_and_both_flips():
    top, left, flip = draw_crop_flip(np.random.default_rng(0), 2000)
    assert set(top.tolist()) == set(range(9)) == set(left.tolist())
    assert 0.4 < flip.mean() < 0.6


def test_normalize():
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    images[1] = 255
    out = normalize(images)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32, 32)
    for c in range(3):
        assert torch.allclose(out[0, c], torch.tensor(-MEAN[c] / STD[c]))
        assert torch.allclose(out[1, c], torch.tensor((1 - MEAN[c]) / STD[c]))


def test_train_batch(tmp_path):
    written = write_cifar10_binary(tmp_path, n_per_batch=8, seed=2)
    task = Cifar10Task(TaskOptions(data_dir=tmp_path))
    indices = np.array([3, 39, 0, 3])
    x, y = task.train_batch(indices, np.random.default_rng(1))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == written.train_labels[indices].tolist()
    expected = normalize(
        augment(torch.from_numpy(written.train_images[indices]), np.random.default_rng(1))
    )
    assert torch.equal(x, expected)


# -- model and defaults ----------------------------------------------------------------


def test_vgg11_shape_and_parameter_count():
    model = VGG11()
    assert sum(p.numel() for p in model.parameters()) == VGG11_NUM_PARAMETERS == 9_225_610
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Dropout)) for m in model.modules())
    with torch.no_grad():
        assert model(torch.randn(3, 3, 32, 32)).shape == (3, 10)


def test_vgg11_seeded_init(tmp_path):
    write_cifar10_binary(tmp_path, n_per_batch=1)
    task = Cifar10Task(TaskOptions(data_dir=tmp_path))
    a, b, c = task.build_model(0), task.build_model(0), task.build_model(1)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert pa.numel() < 1000 or not torch.equal(pa, pc)  # biases start at zero


def test_defaults_follow_the_paper():
    defaults = Cifar10Task.defaults
    assert (defaults.epochs, defaults.batch_size, defaults.momentum) == (200, 32, 0.9)
    assert (defaults.weight_decay, defaults.milestones) == (1e-4, (150, 180))
    assert (defaults.warmup_epochs, defaults.warmup_from, defaults.metric) == (5, 0.0, "worst")
    assert defaults.lr_by_algo["relay"] == 0.15 and defaults.lr_by_algo["d2"] == 0.0125

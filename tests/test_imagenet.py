"""ImageNet task on a tiny class-folder data set of generated images."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from PIL import Image

from relaympi.tasks import TaskError, TaskOptions, get_task_class
from relaympi.tasks.imagenet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageNetTask,
    eval_transform,
    random_resized_crop_box,
    train_transform,
)

WNIDS = ("n01440764", "n01443537", "n02102040")  # deliberately listed in sorted order
COLORS = ((220, 40, 40), (40, 200, 40), (40, 40, 220))


class SmallImageNetTask(ImageNetTask):
    image_size = 32
    resize_size = 36


def _write_image(path: Path, color, size, rng: np.random.Generator) -> None:
    width, height = size
    noise = rng.integers(-30, 30, size=(height, width, 3))
    pixels = np.clip(np.array(color) + noise, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)


def make_imagenet_dir(root: Path, train_per_class: int = 6, val_per_class: int = 2) -> Path:
    """train/<wnid>/*.JPEG and val/<wnid>/*.JPEG with one dominant colour per class."""
    rng = np.random.default_rng(0)
    extensions = (".JPEG", ".jpg", ".jpeg", ".png")
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for wnid, color in zip(WNIDS, COLORS, strict=True):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for k in range(count):
                size = (int(rng.integers(36, 60)), int(rng.integers(36, 60)))
                _write_image(folder / f"{wnid}_{k}{extensions[k % 4]}", color, size, rng)
            (folder / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_imagenet_dir(tmp_path_factory.mktemp("imagenet"))


@pytest.fixture(scope="module")
def task(data_dir) -> SmallImageNetTask:
    return SmallImageNetTask(TaskOptions(data_dir=data_dir, num_loader_workers=0))


def test_registry_and_defaults():
    cls = get_task_class("imagenet")
    assert cls is ImageNetTask and cls.name == "imagenet"
    d = cls.defaults
    assert (d.epochs, d.batch_size, d.optimizer, d.momentum, d.weight_decay) == (
        90,
        32,
        "sgd",
        0.9,
        1e-4,
    )
    assert d.milestones == (30, 60, 80) and d.metric == "mean"
    assert d.lr == pytest.approx(0.1 * 32 * 16 / 256)
    assert d.warmup_epochs == 5 and d.lr * d.warmup_from == pytest.approx(0.1)
    assert (ImageNetTask.image_size, ImageNetTask.resize_size) == (224, 256)


def test_loads_class_folders(task):
    assert task.num_classes == 3 and task.classes == list(WNIDS)
    assert task.train_labels.dtype == np.int64
    np.testing.assert_array_equal(task.train_labels, np.repeat([0, 1, 2], 6))
    np.testing.assert_array_equal(task.test_labels, np.repeat([0, 1, 2], 2))


def test_train_batch_shapes_labels_and_colours(task):
    indices = np.array([0, 7, 17, 3])
    inputs, targets = task.train_batch(indices, np.random.default_rng(1))
    assert inputs.shape == (4, 3, 32, 32) and inputs.dtype == torch.uint8
    assert targets.dtype == torch.int64 and targets.tolist() == [0, 1, 2, 0]
    dominant = inputs.float().mean(dim=(2, 3)).argmax(dim=1)
    assert dominant.tolist() == [0, 1, 2, 0]  # each crop keeps its class colour


def test_train_batch_is_a_function_of_the_rng(task):
    indices = np.arange(18)
    a, _ = task.train_batch(indices, np.random.default_rng(5))
    b, _ = task.train_batch(indices, np.random.default_rng(5))
    c, _ = task.train_batch(indices, np.random.default_rng(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_random_resized_crop_box():
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, w, h = random_resized_crop_box(50, 40, rng)
        assert 0 <= left and left + w <= 50 and 0 <= top and top + h <= 40
        assert 0.08 * 2000 * 0.9 <= w * h <= 2000
        assert 3 / 4 * 0.8 <= w / h <= 4 / 3 * 1.25  # rounding to whole pixels
    # No try can fit a 1000x10 image: fall back to the centred crop of aspect ratio 4/3.
    assert random_resized_crop_box(1000, 10, rng) == (493, 0, 13, 10)
    assert random_resized_crop_box(10, 1000, rng) == (0, 493, 10, 13)


def test_train_transform_flip_and_crop_are_drawn_from_rng():
    pixels = np.arange(40 * 40 * 3, dtype=np.int64).reshape(40, 40, 3) % 251
    image = Image.fromarray(pixels.astype(np.uint8))

    class FullCrop:
        """An rng whose draws give the whole image (area 1, ratio 1, offset 0) and a flip."""

        def __init__(self, flip: bool):
            self.flip = flip

        def uniform(self, low, high):
            return 1.0 if low > 0 else 0.0

        def integers(self, low, high):
            return 0

        def random(self):
            return 0.0 if self.flip else 0.9

    # FullCrop stands in for the Generator
    plain = train_transform(image, 40, cast(np.random.Generator, FullCrop(flip=False)))
    flipped = train_transform(image, 40, cast(np.random.Generator, FullCrop(flip=True)))
    np.testing.assert_array_equal(plain, pixels.transpose(2, 0, 1))
    np.testing.assert_array_equal(flipped, pixels[:, ::-1].transpose(2, 0, 1))


def test_eval_transform_centre_crop_is_exact():
    # 48 wide, 36 high: the shorter side is already 36, so only the centre crop acts.
    pixels = np.random.default_rng(0).integers(0, 256, size=(36, 48, 3)).astype(np.uint8)
    out = eval_transform(Image.fromarray(pixels), size=32, resize=36)
    np.testing.assert_array_equal(out, pixels[2:34, 8:40].transpose(2, 0, 1))


def test_eval_transform_resizes_the_shorter_side():
    # 72 wide, 96 high -> 36 x 48, centre crop rows 8..40, columns 2..34.
    pixels = np.zeros((96, 72, 3), dtype=np.uint8)
    pixels[:, :, 0] = np.arange(96)[:, None]  # red encodes the row
    image = Image.fromarray(pixels)
    out = eval_transform(image, size=32, resize=36)
    reference = np.asarray(image.resize((36, 48), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(out, reference[8:40, 2:34].transpose(2, 0, 1))
    assert abs(int(out[0, 0, 0]) - 17) <= 1 and abs(int(out[0, -1, 0]) - 79) <= 1


def test_test_batches_cover_the_val_set_in_order(task):
    batches = list(task.test_batches(4))
    assert [len(t) for _, t in batches] == [4, 2]
    assert torch.cat([t for _, t in batches]).tolist() == [0, 0, 1, 1, 2, 2]
    assert batches[0][0].shape == (4, 3, 32, 32)
    again = list(task.test_batches(4))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


def test_prefetching_workers_match_serial(task, data_dir):
    parallel = SmallImageNetTask(TaskOptions(data_dir=data_dir, num_loader_workers=2))
    batches = [np.array([0, 5, 9]), np.array([17, 1]), np.array([4, 4, 12, 13])]

    def stream(t):
        rngs = (np.random.default_rng([3, step]) for step in range(len(batches)))
        return list(t.train_batches(iter(batches), rngs))

    serial, prefetched = stream(task), stream(parallel)
    assert len(prefetched) == len(serial) == 3
    for (xa, ya), (xb, yb) in zip(serial, prefetched, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    direct = task.train_batch(batches[1], np.random.default_rng([3, 1]))
    assert torch.equal(direct[0], serial[1][0])
    for (xa, ya), (xb, yb) in zip(task.test_batches(4), parallel.test_batches(4), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_model_forward_and_seeding(task):
    state = torch.random.get_rng_state()
    model = task.build_model(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    same, other = task.build_model(seed=3), task.build_model(seed=4)
    params = [p for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params, same.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(params, other.parameters(), strict=True))
    inputs, _ = task.train_batch(np.arange(5), np.random.default_rng(0))
    assert task.forward(model, inputs).shape == (5, 3)
    # The first layer normalizes uint8 images with the ImageNet mean and std.
    normalized = model[0](torch.full((1, 3, 1, 1), 255, dtype=torch.uint8))
    want = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(normalized.flatten().numpy(), want, rtol=1e-6)


def test_sgd_steps_reduce_the_loss(task):
    torch.manual_seed(0)
    model = task.build_model(seed=0)
    inputs, targets = task.train_batch(np.arange(18), np.random.default_rng(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with torch.no_grad():
        before = task.loss(task.forward(model, inputs), targets).item()
    for _ in range(15):
        optimizer.zero_grad()
        task.loss(task.forward(model, inputs), targets).backward()
        optimizer.step()
    with torch.no_grad():
        after = task.loss(task.forward(model, inputs), targets).item()
    assert after < 0.5 * before


def test_missing_data_dir_errors(tmp_path, data_dir):
    with pytest.raises(TaskError, match="needs --data-dir"):
        ImageNetTask(TaskOptions())
    with pytest.raises(
        TaskError, match=r"train is not a directory; expected DIR/train/<wnid>/\*\.JPEG"
    ):
        ImageNetTask(TaskOptions(data_dir=tmp_path / "nowhere"))
    (tmp_path / "a" / "train").mkdir(parents=True)
    with pytest.raises(TaskError, match=r"a/val is not a directory.*val/<wnid>/ folders"):
        ImageNetTask(TaskOptions(data_dir=tmp_path / "a"))
    (tmp_path / "a" / "val").mkdir()
    with pytest.raises(TaskError, match="holds no class folders"):
        ImageNetTask(TaskOptions(data_dir=tmp_path / "a"))


def test_bad_class_folders(tmp_path):
    root = make_imagenet_dir(tmp_path / "extra", train_per_class=1, val_per_class=1)
    (root / "val" / "n09999999").mkdir()
    with pytest.raises(TaskError, match="class 'n09999999' is not among the 3 classes"):
        SmallImageNetTask(TaskOptions(data_dir=root))
    root = make_imagenet_dir(tmp_path / "empty", train_per_class=1, val_per_class=1)
    (root / "train" / "n09999999").mkdir()
    with pytest.raises(TaskError, match=r"n09999999 holds no images \(expected \*\.JPEG"):
        SmallImageNetTask(TaskOptions(data_dir=root))


def test_undecodable_image_names_the_file(tmp_path):
    root = make_imagenet_dir(tmp_path / "bad", train_per_class=1, val_per_class=1)
    bad = root / "train" / WNIDS[0] / f"{WNIDS[0]}_0.JPEG"
    bad.write_bytes(b"not a jpeg")
    task = SmallImageNetTask(replace(TaskOptions(data_dir=root), num_loader_workers=0))
    with pytest.raises(TaskError, match=f"cannot decode image .*{bad.name}"):
        task.train_batch(np.array([0]), np.random.default_rng(0))


def test_flat_val_folder_is_explained(tmp_path):
    root = make_imagenet_dir(tmp_path / "flat", train_per_class=1, val_per_class=1)
    for wnid in WNIDS:
        for image in (root / "val" / wnid).iterdir():
            image.rename(root / "val" / image.name)
        (root / "val" / wnid).rmdir()
    with pytest.raises(TaskError, match="val holds images directly, not in class folders"):
        SmallImageNetTask(TaskOptions(data_dir=root))

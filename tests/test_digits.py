"""The embedded digits task: split, batches, model and that it actually learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi.tasks import TaskOptions, get_task_class
from relaympi.tasks.digits import DigitsTask, stratified_split
from relaympi.tasks.partition import ShardSampler


@pytest.fixture(scope="module")
def task() -> DigitsTask:
    return DigitsTask(TaskOptions())


@pytest.fixture
def one_thread():
    # A 64-64-10 MLP is dominated by thread hand-off costs; one thread is ~10x faster here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_registered_under_its_name():
    assert get_task_class("digits") is DigitsTask
    assert DigitsTask.name == "digits"


def test_split_sizes_and_labels(task):
    assert task.num_classes == 10
    labels = task.train_labels
    assert labels.dtype == np.int64 and labels.shape == (1438,)
    assert task.num_test == 359
    assert np.bincount(labels, minlength=10).min() >= 130  # stratified: every class present
    test_labels = torch.cat([y for _, y in task.test_batches(100)]).numpy()
    assert np.bincount(test_labels, minlength=10).min() >= 35


def test_split_does_not_depend_on_the_run_seed(task):
    other = DigitsTask(TaskOptions(seed=123))
    assert np.array_equal(other.train_labels, task.train_labels)
    ours = torch.cat([x for x, _ in task.test_batches(256)])
    theirs = torch.cat([x for x, _ in other.test_batches(256)])
    assert torch.equal(ours, theirs)


def test_stratified_split_is_disjoint_and_complete():
    labels = np.repeat(np.arange(3), [10, 20, 31])
    train, test = stratified_split(labels, 0.2, seed=0)
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(labels)))
    assert np.bincount(labels[test]).tolist() == [2, 4, 6]


def test_train_batch(task):
    indices = np.array([0, 5, 1437, 5])
    x, y = task.train_batch(indices, np.random.default_rng(0))
    assert x.shape == (4, 64) and x.dtype == torch.float32
    assert y.shape == (4,) and y.dtype == torch.int64
    assert y.tolist() == task.train_labels[indices].tolist()
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.9
    x_again, _ = task.train_batch(indices, np.random.default_rng(99))
    assert torch.equal(x, x_again), "no augmentation: the rng is ignored"


def test_test_batches_cover_the_test_set_in_order(task):
    sizes = [len(y) for _, y in task.test_batches(100)]
    assert sizes == [100, 100, 100, 59]
    first = torch.cat([x for x, _ in task.test_batches(100)])
    second = torch.cat([x for x, _ in task.test_batches(7)])
    assert torch.equal(first, second)


def test_model_shape_and_seeded_init(task):
    model = task.build_model(seed=1)
    x, _ = task.train_batch(np.arange(5), np.random.default_rng(0))
    assert model(x).shape == (5, 10)
    assert sum(p.numel() for p in model.parameters()) == 64 * 64 + 64 + 64 * 10 + 10
    same = task.build_model(seed=1)
    other = task.build_model(seed=2)
    for a, b, c in zip(model.parameters(), same.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


def test_build_model_leaves_the_global_torch_rng_alone(task):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    task.build_model(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_sgd_on_one_worker_learns_digits(task, one_thread):
    model = task.build_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    sampler = ShardSampler(np.arange(len(task.train_labels)), batch_size=32, seed=0, rank=0)
    for step in range(300):
        x, y = task.train_batch(sampler.batch(step), sampler.rng(step))
        loss = task.loss(task.forward(model, x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    correct = 0
    with torch.no_grad():
        for x, y in task.test_batches(256):
            correct += (model(x).argmax(dim=1) == y).sum().item()
    assert correct / task.num_test > 0.9


def test_train_batches_builds_no_generator(task):
    """Digits draws no augmentation: its batch stream never asks for a step's generator (each
    costs tens of microseconds), and gives train_batch's batches."""
    sampler = ShardSampler(np.arange(len(task.train_labels)), batch_size=8, seed=0, rank=1)

    def no_generators():
        raise AssertionError("a step's generator was built")
        yield  # pragma: no cover - makes this a generator

    stream = task.train_batches((sampler.batch(s) for s in range(5)), no_generators())
    for step, (x, y) in enumerate(stream):
        expected_x, expected_y = task.train_batch(sampler.batch(step), sampler.rng(step))
        assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    assert step == 4

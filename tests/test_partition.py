"""Dirichlet partitioning, per-worker batch streams and epoch arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from relaympi.tasks.partition import (
    ShardSampler,
    class_histogram,
    dirichlet_partition,
    steps_per_epoch,
)

# CIFAR-10-sized label sets are cheap here: the draws only count per class.
CIFAR_LABELS = np.random.default_rng(7).permutation(np.repeat(np.arange(10), 5000))
SMALL_LABELS = np.random.default_rng(8).permutation(np.repeat(np.arange(10), 144))


def _top_share(labels: np.ndarray, parts: list[np.ndarray], top: int) -> float:
    """Mean over workers of the fraction of their samples in their ``top`` largest classes."""
    hist = np.sort(class_histogram(labels, parts, 10), axis=1)[:, ::-1]
    return float((hist[:, :top].sum(axis=1) / hist.sum(axis=1)).mean())


@pytest.mark.parametrize("labels", [CIFAR_LABELS, SMALL_LABELS], ids=["cifar", "small"])
@pytest.mark.parametrize("alpha", [0.01, 0.1, 1.0, 1000.0, math.inf])
@pytest.mark.parametrize("balance", [True, False])
def test_every_sample_on_exactly_one_worker(labels, alpha, balance):
    parts = dirichlet_partition(labels, 16, alpha, seed=3, balance=balance)
    assert len(parts) == 16
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "each worker's indices are sorted and unique"
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


@pytest.mark.parametrize("alpha", [0.01, 0.1, 1.0])
def test_each_worker_keeps_half_its_share(alpha):
    for seed in range(3):
        parts = dirichlet_partition(CIFAR_LABELS, 16, alpha, seed, balance=False)
        assert min(len(part) for part in parts) >= 0.5 * len(CIFAR_LABELS) / 16


def _taken_while_full(alpha: float, seed: int, workers: int = 8) -> np.ndarray:
    """Per worker and class: samples received although the worker already held its share.

    Lin et al.'s cap: classes are dealt in order, and a worker that already holds its share
    (n_samples / workers; one group of <= 10 workers here) gets nothing of any later class.
    """
    share = len(SMALL_LABELS) / workers
    parts = dirichlet_partition(SMALL_LABELS, workers, alpha, seed, balance=False)
    hist = class_histogram(SMALL_LABELS, parts, 10)
    held_before = np.cumsum(hist, axis=1) - hist
    return np.where(held_before >= share, hist, 0)


@pytest.mark.parametrize("alpha", [0.01, 0.1, 1.0])
def test_full_workers_take_no_more_classes(alpha):
    for seed in range(4):
        # at most 1 sample: the rounding slip of the xfail test below
        assert _taken_while_full(alpha, seed).max() <= 1, (alpha, seed)


@pytest.mark.xfail(
    strict=True,
    reason="partition.py: cumsum(p / total) of the capped last worker can end "
    "at 0.9999999999999999, so floor() hands it one sample of the class",
)
def test_full_last_worker_gets_no_stray_sample():
    assert _taken_while_full(0.1, 1).max() == 0


def test_balance_gives_equal_sizes():
    parts = dirichlet_partition(SMALL_LABELS, 16, 0.01, seed=0)
    assert {len(part) for part in parts} == {90}
    parts = dirichlet_partition(SMALL_LABELS[:1430], 16, 0.01, seed=0)
    assert sorted(len(part) for part in parts) == [89] * 10 + [90] * 6


def test_same_seed_same_partition_other_seed_other_partition():
    first = dirichlet_partition(CIFAR_LABELS, 16, 0.1, seed=5)
    again = dirichlet_partition(CIFAR_LABELS, 16, 0.1, seed=5)
    other = dirichlet_partition(CIFAR_LABELS, 16, 0.1, seed=6)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("labels", [CIFAR_LABELS, SMALL_LABELS], ids=["cifar", "small"])
def test_small_alpha_gives_one_or_two_classes_per_worker(labels):
    for seed in range(3):
        raw = dirichlet_partition(labels, 16, 0.01, seed, balance=False)
        assert _top_share(labels, raw, 1) > 0.75
        assert _top_share(labels, raw, 2) > 0.9
        balanced = dirichlet_partition(labels, 16, 0.01, seed)
        assert _top_share(labels, balanced, 2) > 0.85


@pytest.mark.parametrize("alpha", [1000.0, math.inf])
def test_large_alpha_is_close_to_iid(alpha):
    parts = dirichlet_partition(CIFAR_LABELS, 16, alpha, seed=1, balance=False)
    hist = class_histogram(CIFAR_LABELS, parts, 10).astype(float)
    expected = hist.sum(axis=1, keepdims=True) / 10
    chi2 = ((hist - expected) ** 2 / expected).sum(axis=1)
    # 9 degrees of freedom: iid sampling gives chi2 ~ 9 +- 4.2; Dir(1000) adds ~1.6x.
    assert chi2.max() < 60
    assert _top_share(CIFAR_LABELS, parts, 1) < 0.13


def test_one_worker_gets_everything():
    (part,) = dirichlet_partition(SMALL_LABELS, 1, 0.01, seed=0)
    assert np.array_equal(part, np.arange(len(SMALL_LABELS)))


def test_class_histogram():
    labels = np.array([0, 1, 1, 2, 2, 2])
    hist = class_histogram(labels, [np.array([0, 1]), np.array([2, 3, 4, 5])], 4)
    assert hist.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, "alpha must be positive.*0.0"),
        ({"alpha": -1.0}, "alpha must be positive.*-1.0"),
        ({"alpha": math.nan}, "alpha must be a positive number.*nan"),
        ({"alpha": "1"}, "alpha must be a positive number.*'1'"),
        ({"world_size": 0}, "world_size must be a positive integer, got 0"),
        ({"world_size": 2.0}, "world_size must be a positive integer, got 2.0"),
        (
            {"world_size": 1441},
            r"world_size must be at most the number of samples \(1440\), got 1441",
        ),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
        (
            {"labels": np.zeros((4, 2), dtype=int)},
            r"labels must be a 1-D array, got shape \(4, 2\)",
        ),
        ({"labels": np.zeros(4)}, "labels must be integers, got dtype float64"),
        ({"labels": np.zeros(0, dtype=int)}, "labels must not be empty"),
    ],
)
def test_bad_inputs_name_the_value(kwargs, message):
    args = {"labels": SMALL_LABELS, "world_size": 16, "alpha": 0.1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        dirichlet_partition(**args)


def test_impossible_partition_gives_up_with_a_clear_error():
    labels = np.repeat(np.arange(2), 50)  # 2 classes, 10 workers, alpha tiny: hopeless
    with pytest.raises(ValueError, match="could not draw a Dirichlet partition.*5 attempts"):
        dirichlet_partition(labels, 10, 1e-3, seed=0, max_attempts=5)


# -- ShardSampler -------------------------------------------------------------------------


def test_each_pass_covers_the_shard_once():
    shard = np.arange(100, 137)  # 37 samples, batch 5: passes end mid-batch
    sampler = ShardSampler(shard, batch_size=5, seed=1, rank=2)
    stream = np.concatenate([sampler.batch(step) for step in range(23)])
    for k in range(3):
        assert np.array_equal(np.sort(stream[37 * k : 37 * (k + 1)]), shard)
    assert not np.array_equal(stream[:37], stream[37:74]), "each pass is reshuffled"


def test_pass_k_is_the_documented_permutation():
    shard = np.arange(10) * 3
    sampler = ShardSampler(shard, batch_size=4, seed=9, rank=1)
    stream = np.concatenate([sampler.batch(step) for step in range(5)])
    expected = np.concatenate(
        [shard[np.random.default_rng([9, 1, k]).permutation(10)] for k in range(2)]
    )
    assert np.array_equal(stream, expected)


def test_batches_larger_than_the_shard_wrap_over_several_passes():
    sampler = ShardSampler(np.array([4, 8, 15]), batch_size=7, seed=0, rank=0)
    batch = sampler.batch(2)  # stream positions 14..20: passes 4 (2 left), 5, 6
    assert batch.shape == (7,)
    assert sorted(batch[1:4].tolist()) == [4, 8, 15]
    assert sorted(batch[4:7].tolist()) == [4, 8, 15]


def test_a_batch_is_a_pure_function_of_the_step():
    shard = np.arange(0, 200, 3)
    walked = ShardSampler(shard, batch_size=8, seed=4, rank=3)
    for step in range(37):
        walked.batch(step)
    fresh = ShardSampler(shard, batch_size=8, seed=4, rank=3)
    assert np.array_equal(fresh.batch(37), walked.batch(37))
    assert np.array_equal(fresh.batch(3), ShardSampler(shard, 8, 4, 3).batch(3))
    assert np.array_equal(fresh.rng(37).integers(0, 1000, 5), walked.rng(37).integers(0, 1000, 5))


def test_ranks_and_seeds_differ():
    shard = np.arange(64)
    batches = {
        (seed, rank): ShardSampler(shard, 16, seed, rank).batch(0).tolist()
        for seed in (0, 1)
        for rank in (0, 1)
    }
    assert len({tuple(batch) for batch in batches.values()}) == 4
    assert (
        ShardSampler(shard, 16, 0, 0).rng(0).random()
        != ShardSampler(shard, 16, 0, 1).rng(0).random()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((np.array([], dtype=int), 4, 0, 0), "non-empty 1-D array"),
        ((np.arange(4), 0, 0, 0), "batch_size must be positive, got 0"),
        ((np.arange(4), 2, -1, 0), "seed must be a non-negative integer, got -1"),
        ((np.arange(4), 2, 0, -2), "rank must be non-negative, got -2"),
    ],
)
def test_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        ShardSampler(*args)


def test_steps_per_epoch():
    assert steps_per_epoch(50_000, 16, 32) == 98  # 97.66 rounded up
    assert steps_per_epoch(512, 16, 32) == 1
    assert steps_per_epoch(1438, 16, 8) == 12
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        steps_per_epoch(100, 2, 0)

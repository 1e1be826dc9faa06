"""Which training samples each worker holds (Dirichlet split) and sees at each step."""

from __future__ import annotations

import math

import numpy as np

# Lin et al. (2021) split workers into groups of at most 10 and run the Dirichlet draw
# within each group on a proportional random slice of the data; the RelaySGD code the
# paper ran uses the same value. Without groups, 10 classes over 16 workers at
# alpha=0.01 practically never satisfy the half-share rule (each class lands on one
# worker, so 6 workers stay empty).
_GROUP_SIZE = 10
_MAX_ATTEMPTS = 10_000


class PartitionError(ValueError):
    """The data cannot be split as asked: more workers than samples, or no Dirichlet draw left
    every worker half its share (a property of the data, world size, alpha and seed, not a bug)."""


def dirichlet_partition(
    labels: np.ndarray,
    world_size: int,
    alpha: float,
    seed: int,
    *,
    group_size: int = _GROUP_SIZE,
    balance: bool = True,
    max_attempts: int = _MAX_ATTEMPTS,
) -> list[np.ndarray]:
    """Split sample indices over ``world_size`` workers with Dirichlet(alpha) class mixtures.

    The sampling procedure of Lin et al. (2021, "Quasi-global momentum"), as cited by the
    RelaySum paper (appendix "Detailed experimental setup"):

    1. Shuffle all indices (seeded) and cut them into groups of at most ``group_size``
       workers, each group receiving a slice proportional to its number of workers.
    2. Within a group, for every class, draw proportions ~ Dir(alpha) over its workers,
       set the proportion of workers that already hold their share (group size / workers)
       to 0, renormalize, and split the class's indices by these proportions.
    3. Repeat step 2 with fresh draws until every worker holds at least half its share
       (at most ``max_attempts`` times per group, then PartitionError).
    4. With ``balance`` (the default, as in the code the paper's experiments ran), the
       workers' index lists are concatenated in worker order and cut into ``world_size``
       contiguous pieces of equal size (sizes differ by at most one), which keeps each
       worker's class mix but equalizes the number of samples.

    ``alpha=math.inf`` means iid: a seeded random split into equal pieces. Large finite
    alphas approach it. Only ``numpy.random.default_rng(seed)`` is used, so every rank
    computes the same partition. Every sample lands on exactly one worker; each worker's
    indices are returned sorted ascending (int64).
    """
    labels = _check_labels(labels)
    _check_worker_count(world_size, len(labels))
    _check_alpha(alpha)
    _check_seed(seed)
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    if math.isinf(alpha):
        return [np.sort(part) for part in np.array_split(order, world_size)]

    parts: list[np.ndarray] = []
    for lo, hi, workers in _groups(len(labels), world_size, group_size):
        parts.extend(_split_group(order[lo:hi], labels, workers, alpha, rng, max_attempts))
    if balance:
        parts = np.array_split(np.concatenate(parts), world_size)
    return [np.sort(part) for part in parts]


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {labels.shape}")
    if len(labels) == 0:
        raise ValueError("labels must not be empty")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    return labels


def _check_worker_count(world_size: int, num_samples: int) -> None:
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size > num_samples:
        raise PartitionError(
            f"world_size must be at most the number of samples ({num_samples}), got {world_size}"
        )


def _check_alpha(alpha: float) -> None:
    if not isinstance(alpha, (int, float, np.floating, np.integer)) or math.isnan(alpha):
        raise ValueError(f"alpha must be a positive number or math.inf (iid), got {alpha!r}")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive (or math.inf for iid), got {alpha!r}")


def _check_seed(seed: int) -> None:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def _groups(num_samples: int, world_size: int, group_size: int) -> list[tuple[int, int, int]]:
    """(start, stop, workers) of each group's slice of the shuffled indices."""
    groups = []
    first_worker, start = 0, 0
    while first_worker < world_size:
        workers = min(group_size, world_size - first_worker)
        first_worker += workers
        stop = num_samples * first_worker // world_size
        groups.append((start, stop, workers))
        start = stop
    return groups


def _split_group(
    indices: np.ndarray,
    labels: np.ndarray,
    workers: int,
    alpha: float,
    rng: np.random.Generator,
    max_attempts: int,
) -> list[np.ndarray]:
    """Lin et al.'s capped Dirichlet draw over one group, repeated until sizes are fair."""
    group_labels = labels[indices]
    by_class = [indices[group_labels == c] for c in np.unique(group_labels)]
    share = len(indices) / workers
    for _ in range(max_attempts):
        cuts = _draw_cuts(by_class, workers, alpha, share, rng)
        if cuts is not None:
            return _apply_cuts(by_class, cuts, workers)
    raise PartitionError(
        f"could not draw a Dirichlet partition with alpha={alpha} for a group of {workers} "
        f"workers sharing {len(indices)} samples in {max_attempts} attempts: some worker "
        f"kept fewer than half its share ({share:.1f} samples); use a larger alpha, fewer "
        "workers or more data"
    )


def _draw_cuts(
    by_class: list[np.ndarray],
    workers: int,
    alpha: float,
    share: float,
    rng: np.random.Generator,
) -> list[np.ndarray] | None:
    """Split points of every class for one attempt, or None if the attempt fails."""
    sizes = np.zeros(workers, dtype=np.int64)
    cuts = []
    for members in by_class:
        proportions = rng.dirichlet(np.full(workers, alpha))
        # Workers that already hold their share take nothing more of this class.
        proportions = np.where(sizes < share, proportions, 0.0)
        total = proportions.sum()
        if not total > 0:  # tiny alphas can put all the mass on full workers
            return None
        cut = (np.cumsum(proportions / total) * len(members)).astype(np.int64)[:-1]
        sizes += np.diff(cut, prepend=0, append=len(members))
        cuts.append(cut)
    return cuts if sizes.min() >= 0.5 * share else None


def _apply_cuts(
    by_class: list[np.ndarray], cuts: list[np.ndarray], workers: int
) -> list[np.ndarray]:
    pieces: list[list[np.ndarray]] = [[] for _ in range(workers)]
    for members, cut in zip(by_class, cuts, strict=True):
        for worker, chunk in enumerate(np.split(members, cut)):
            pieces[worker].append(chunk)
    return [np.concatenate(chunks).astype(np.int64) for chunks in pieces]


def class_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """[world_size, num_classes] count of each class on each worker."""
    labels = np.asarray(labels)
    return np.stack(
        [np.bincount(labels[part], minlength=num_classes)[:num_classes] for part in parts]
    )


def steps_per_epoch(num_train: int, world_size: int, batch_size: int) -> int:
    """Steps for all workers together to see as many samples as the training set holds."""
    for name, value in (
        ("num_train", num_train),
        ("world_size", world_size),
        ("batch_size", batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    return math.ceil(num_train / (world_size * batch_size))


class ShardSampler:
    """A worker's batches: its shard reshuffled every pass, addressed by global step.

    The worker's sample stream is the concatenation of permutations of its shard;
    permutation k comes from ``np.random.default_rng([seed, rank, k])``, and step s takes
    stream positions [s * batch_size, (s + 1) * batch_size). A batch is thus a pure
    function of (indices, batch_size, seed, rank, step), so a resumed run continues with
    exactly the batches it would have seen.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int, rank: int):
        indices = np.asarray(indices)
        if indices.ndim != 1 or len(indices) == 0:
            raise ValueError(
                "indices must be a non-empty 1-D array (the worker's shard), got shape "
                f"{indices.shape}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        _check_seed(seed)
        if rank < 0:
            raise ValueError(f"rank must be non-negative, got {rank}")
        self.indices = indices.astype(np.int64, copy=True)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self._cache: dict[int, np.ndarray] = {}

    def _pass(self, k: int) -> np.ndarray:
        """The shard in the order of pass k (cached: consecutive steps reuse it)."""
        if k not in self._cache:
            order = np.random.default_rng([self.seed, self.rank, k]).permutation(len(self.indices))
            self._cache[k] = self.indices[order]
        return self._cache[k]

    def batch(self, step: int) -> np.ndarray:
        """Sample indices of this worker's batch at global step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        size = len(self.indices)
        k, offset = divmod(step * self.batch_size, size)
        pieces, needed = [], self.batch_size
        while needed > 0:
            taken = self._pass(k)[offset : offset + needed]
            pieces.append(taken)
            needed -= len(taken)
            k, offset = k + 1, 0
        last = k - 1
        self._cache = {last: self._cache[last]}
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)

    def rng(self, step: int) -> np.random.Generator:
        """The augmentation random generator of step ``step``."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return np.random.default_rng([self.seed, self.rank, step, 1])

"""The embedded default task: scikit-learn's bundled 8x8 digits with a small MLP."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from relaympi.tasks.base import ClassificationTask, TaskDefaults, TaskOptions
from relaympi.tasks.models import digits_mlp, parameter_bytes, seeded

# The train/test split is part of the task, not of a run: a constant seed gives every
# run (any --seed, any world size) the same 1438 training and 359 test images.
_SPLIT_SEED = 20210614
TEST_FRACTION = 0.2


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) sorted indices with round(test_fraction * count) test samples per class."""
    rng = np.random.default_rng(seed)
    test = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        test.append(rng.permutation(members)[: round(test_fraction * len(members))])
    test_indices = np.sort(np.concatenate(test))
    train_indices = np.setdiff1d(np.arange(len(labels)), test_indices)
    return train_indices, test_indices


class DigitsTask(ClassificationTask):
    """8x8 handwritten digits (1797 images, 10 classes) from ``sklearn.datasets.load_digits``.

    Real data that ships with scikit-learn, so it works offline. Pixels are scaled from
    0..16 to [0, 1]; no augmentation (``train_batch`` ignores its rng).
    """

    name = "digits"
    train_size = 1438  # of sklearn's 1797 images (the constant split above)
    # 1438 training images: with 16 workers and 8 samples each, one epoch is 12 steps, so 20 epochs
    # are 240 steps; 16 workers take ~2 s of one CPU core (torch with one thread). lr 0.1 is a
    # placeholder until tuned per algorithm (centralized, i.e. all-reduce over 16 x 8 samples: 0.1
    # reaches ~92% test accuracy, 0.3 ~97%). Learning rates: the best of lr in {0.05, 0.1, ..., 3.2}
    # (x2 grid) for 16 workers, alpha = 0.01, 20 epochs, seed 0, plain SGD (qgm: momentum 0.9), by
    # the paper's worst-worker metric (`python -m relaympi.report`): allreduce 96.5%, relay-grad
    # 97.2%, qgm 96.0%, relay 94.1%, gt 92.4%, d2 91.9%, sgp 85.6%, dpsgd 73.5%. The grid loop is in
    # docs/benchmarks.md ("Learning-rate grid on digits").
    defaults = TaskDefaults(
        epochs=20,
        batch_size=8,
        lr=0.1,
        lr_by_algo={
            "allreduce": 0.4,
            "relay": 1.6,
            "relay-grad": 1.6,
            "dpsgd": 0.4,
            "qgm": 0.4,
            "d2": 0.1,
            "gt": 0.8,
            "sgp": 0.1,
        },
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        eval_every_epochs=1.0,
        metric="worst",
    )

    def __init__(self, options: TaskOptions):
        super().__init__(options)
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.data / 16.0).astype(np.float32)
        labels = digits.target.astype(np.int64)
        train, test = stratified_split(labels, TEST_FRACTION, _SPLIT_SEED)
        device = torch.device(options.device)
        self._train_labels = labels[train]
        self._train_x = torch.from_numpy(images[train]).to(device)
        self._train_y = torch.from_numpy(labels[train]).to(device)
        self._test_x = torch.from_numpy(images[test]).to(device)
        self._test_y = torch.from_numpy(labels[test]).to(device)

    @property
    def num_classes(self) -> int:
        return 10

    @property
    def train_labels(self) -> np.ndarray:
        return self._train_labels

    @property
    def num_test(self) -> int:
        return len(self._test_y)

    def build_model(self, seed: int) -> torch.nn.Module:
        return seeded(seed, digits_mlp).to(self.options.device)

    @classmethod
    def model_bytes(cls, settled: dict, problem: object) -> int:
        return parameter_bytes(digits_mlp)

    def train_batch(
        self, indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self._train_x.device)
        return self._train_x[index], self._train_y[index]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        for start in range(0, len(self._test_y), batch_size):
            yield self._test_x[start : start + batch_size], self._test_y[start : start + batch_size]

"""The embedded default task: scikit-learn's bundled 8x8 digits with a small MLP."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from relaympi.tasks.base import ClassificationTask, TaskOptions
from relaympi.tasks.defaults import DIGITS
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
    defaults = DIGITS

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
        return self._batch(indices)

    def train_batches(
        self, batch_indices: Iterator[np.ndarray], rngs: Iterator[np.random.Generator]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of ``batch_indices``; ``rngs`` is never advanced: digits draws no
        augmentation, and building a step's generator costs about 40 us, a tenth of this task's
        step."""
        for indices in batch_indices:
            yield self._batch(indices)

    def _batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self._train_x.device)
        return self._train_x[index], self._train_y[index]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        for start in range(0, len(self._test_y), batch_size):
            yield self._test_x[start : start + batch_size], self._test_y[start : start + batch_size]

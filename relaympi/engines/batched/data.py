"""Every worker's training batch of a step, stacked [N, B, ...]: the same samples and augmentation
as the other backends.

Worker r's batch at step s is ``ShardSampler(shard_r, B, seed, r).batch(s)``, augmented with
``.rng(s)``, exactly as ``ModelWorkload`` draws it. CIFAR-10 batches are assembled for all
workers at once on the training device: its uint8 training set is copied there once, the crop
offsets and flips are drawn from each worker's generator in the task's order, and crop, flip
and normalization run as one gather over the N x B images.
"""

from __future__ import annotations

import numpy as np
import torch

from relaympi.batched.base import to_device
from relaympi.tasks import cifar10
from relaympi.tasks.base import ClassificationTask
from relaympi.tasks.digits import DigitsTask
from relaympi.tasks.partition import ShardSampler, steps_per_epoch


class BatchedData:
    """Batches of N workers with Dirichlet shards ``parts`` (from ``dirichlet_partition``)."""

    def __init__(
        self,
        task: ClassificationTask,
        parts: list[np.ndarray],
        batch_size: int,
        seed: int,
        device: torch.device | str,
    ):
        self.task = task
        self.world_size = len(parts)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.samplers = [
            ShardSampler(part, batch_size, seed, rank) for rank, part in enumerate(parts)
        ]
        self._every_sampler = list(self.samplers)  # by original id: for workers re-admitted
        self.steps_per_epoch = steps_per_epoch(len(task.train_labels), self.world_size, batch_size)
        self._images: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        # digits batches are rows gathered by index, no augmentation: one gather serves all workers
        self._gather_only = isinstance(task, DigitsTask)
        if isinstance(task, cifar10.Cifar10Task):
            # the task keeps its training set as uint8 tensors in host memory; one device copy
            # serves all workers
            images, targets = task.train_tensors
            self._images, self._targets = images.to(self.device), targets.to(self.device)

    @property
    def workers(self) -> list[int]:
        """The original id (the rank its sampler draws with) of each row of a batch, in order."""
        return [sampler.rank for sampler in self.samplers]

    def keep_workers(self, rows: list[int]) -> None:
        """Keep the workers at positions ``rows`` (in that order): each keeps its shard and its
        sampler, whose stream is keyed by its original id, so it draws exactly the batches it
        would have drawn; a dropped worker's shard leaves with it. The steps per epoch stay the
        run's (its schedule was set from them)."""
        if not rows or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct positions, at least one, got {rows}")
        self.samplers = [self.samplers[row] for row in rows]
        self.world_size = len(self.samplers)

    def restore_workers(self, workers: list[int]) -> None:
        """The inverse of ``keep_workers``: the rows become the workers of original ids
        ``workers`` (in that order), a re-admitted one with its own shard and the sampler keyed by
        its id, so it draws the batches it would have drawn had it never left."""
        if not workers or len(set(workers)) != len(workers):
            raise ValueError(f"workers must be distinct original ids, at least one, got {workers}")
        if not all(0 <= w < len(self._every_sampler) for w in workers):
            raise ValueError(f"workers must be in [0, {len(self._every_sampler)}), got {workers}")
        self.samplers = [self._every_sampler[w] for w in workers]
        self.world_size = len(self.samplers)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [N, B, ...], targets [N, B]) of step ``step`` on the training device."""
        if self._images is not None:
            return self._image_batch(step)
        if self._gather_only:
            indices = np.concatenate([sampler.batch(step) for sampler in self.samplers])
            # DigitsTask ignores the rng
            inputs, targets = self.task.train_batch(indices, self.samplers[0].rng(step))
            inputs, targets = (
                inputs.view(self.world_size, self.batch_size, *inputs.shape[1:]),
                targets.view(self.world_size, -1),
            )
            return to_device(inputs, None, self.device), to_device(targets, None, self.device)
        pairs = [
            self.task.train_batch(sampler.batch(step), sampler.rng(step))
            for sampler in self.samplers
        ]
        inputs = torch.stack([inputs for inputs, _ in pairs])
        targets = torch.stack([targets for _, targets in pairs])
        return to_device(inputs, None, self.device), to_device(targets, None, self.device)

    def _image_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._images is not None and self._targets is not None  # CIFAR-10's, on the device
        n, b = self.world_size, self.batch_size
        indices = np.concatenate([sampler.batch(step) for sampler in self.samplers])
        draws = [cifar10.draw_crop_flip(sampler.rng(step), b) for sampler in self.samplers]
        top, left, flip = (
            to_device(np.concatenate(column), None, self.device)
            for column in zip(*draws, strict=True)
        )
        index = to_device(indices, None, self.device)
        images = cifar10.crop_flip(self._images[index], top, left, flip)
        inputs = cifar10.normalize(images)
        return inputs.view(n, b, *inputs.shape[1:]), self._targets[index].view(n, b)

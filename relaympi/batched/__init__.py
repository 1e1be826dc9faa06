"""The batched engine: all workers of a run as one computation on one device (``--backend batched``)."""

from relaympi.batched.algorithms import BATCHED_ALGORITHMS, make_batched_algorithm
from relaympi.batched.base import BatchedAlgorithm
from relaympi.batched.optim import BatchedOptimizer

__all__ = ["BATCHED_ALGORITHMS", "BatchedAlgorithm", "BatchedOptimizer", "make_batched_algorithm"]

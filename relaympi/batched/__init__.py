"""The vectorized forms of the optimizers and algorithms: every worker's step at once, on stacked
[N, d] tensors. The batched engine (relaympi.engines.batched, ``--backend batched``) runs them."""

from relaympi.batched.algorithms import BATCHED_ALGORITHMS, make_batched_algorithm
from relaympi.batched.base import BatchedAlgorithm
from relaympi.batched.optim import BatchedOptimizer

__all__ = ["BATCHED_ALGORITHMS", "BatchedAlgorithm", "BatchedOptimizer", "make_batched_algorithm"]

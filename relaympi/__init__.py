"""relaympi: RelaySGD and decentralized-learning baselines on MPI."""

__version__ = "0.1.0"

"""D²'s rule on its gossip matrix (torch-free: the topology command line prints the verdict)."""

from __future__ import annotations

from fractions import Fraction

# D² converges only if the gossip matrix's smallest eigenvalue is >= -1/3 (Tang et al. 2018).
D2_MIN_EIGENVALUE = Fraction(-1, 3)


def d2_allows(smallest_eigenvalue: float) -> bool:
    """Whether D² may gossip with a matrix whose smallest eigenvalue is this (to rounding)."""
    return smallest_eigenvalue >= D2_MIN_EIGENVALUE - 1e-12

"""Decentralized optimizers over a Communicator: RelaySGD, RelaySGD/Grad and the paper's baselines.

Names load on first use (PEP 562): the torch-free parts (RelaySGD's lr correction, D²'s
eigenvalue rule) serve `python -m relaympi.topology` without importing torch, and the registry
with each algorithm's options (registry, options) serves the run's configuration without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "ALGORITHMS": "registry",
    "ALGORITHM_NAMES": "registry",
    "DECLARED": "registry",
    "communication": "registry",
    "check_combination": "registry",
    "check_topology_fits_world": "registry",
    "default_topology": "registry",
    "needs_momentum": "registry",
    "get_algorithm_class": "registry",
    "make_algorithm": "registry",
    "ALGORITHM_OPTIONS": "registry",
    "AlgorithmOptions": "registry",
    "algorithm_options": "registry",
    "RELAY_MODES": "options",
    "AlgorithmError": "options",
    "Options": "options",
    "Algorithm": "base",
    "round_id": "base",
    "lr_correction": "relay_lr",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "ALGORITHM_OPTIONS",
    "DECLARED",
    "RELAY_MODES",
    "Algorithm",
    "AlgorithmError",
    "AlgorithmOptions",
    "Options",
    "algorithm_options",
    "check_combination",
    "check_topology_fits_world",
    "communication",
    "default_topology",
    "get_algorithm_class",
    "lr_correction",
    "make_algorithm",
    "needs_momentum",
    "round_id",
]

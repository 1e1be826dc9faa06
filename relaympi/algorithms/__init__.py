"""Decentralized optimizers over a Communicator: RelaySGD, RelaySGD/Grad and the paper's baselines.

Names load on first use (PEP 562): the torch-free parts (RelaySGD's lr correction, D²'s
eigenvalue rule) serve `python -m relaympi.topology` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "ALGORITHMS": "registry",
    "ALGORITHM_NAMES": "registry",
    "check_combination": "registry",
    "check_topology_fits_world": "registry",
    "default_topology": "registry",
    "get_algorithm_class": "registry",
    "make_algorithm": "registry",
    "RELAY_MODES": "base",
    "Algorithm": "base",
    "AlgorithmError": "base",
    "AlgorithmOptions": "base",
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
    "RELAY_MODES",
    "Algorithm",
    "AlgorithmError",
    "AlgorithmOptions",
    "check_combination",
    "check_topology_fits_world",
    "default_topology",
    "get_algorithm_class",
    "lr_correction",
    "make_algorithm",
    "round_id",
]

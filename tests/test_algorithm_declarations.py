"""Every registered algorithm declares, in its class and its registry line, everything the rest of
the code reads of it; a missing piece is named with the file and attribute where it goes."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relaympi.algorithms import ALGORITHM_NAMES, DECLARED, RELAY_MODES, get_algorithm_class
from relaympi.algorithms.base import Algorithm, MatrixForm, Topologies
from relaympi.algorithms.options import Options
from relaympi.algorithms.registry import Communication, Declared
from relaympi.topology import build
from tests.algorithm_cases import TESTS, cases

REGISTRY = "relaympi/algorithms/registry.py"
ROOT = Path(__file__).resolve().parent.parent

# what its class declares: (attribute, its type, what it says)
CLASS_DECLARES = (
    ("name", str, "its --algo value, the registry's key"),
    ("summary", str, "one line for the docs' algorithm table"),
    ("default_topology", str, "the topology it runs on without --topology"),
    ("topologies", Topologies, "which topologies it takes: a Topologies predicate"),
    ("needs_momentum", bool, "whether it takes only SGD with momentum"),
    ("matrix_form", type, "its MatrixForm: the oracle, and what a lost message does"),
    ("heal_rule", str, "what it does over the survivors of a lost worker"),
)


def _where(cls: type) -> str:
    path = Path(inspect.getfile(cls)).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def missing(algo: str, cls: type[Algorithm], declared: Declared) -> list[str]:
    """What ``algo`` leaves undeclared, each as 'the file: the attribute: what it says'."""
    found = []
    module = _where(cls)
    for attribute, kind, what in CLASS_DECLARES:
        value = getattr(cls, attribute, None)
        if not isinstance(value, kind) or value == "":
            found.append(f"{algo}: {module}: class {cls.__name__} needs `{attribute}` ({what})")
    if getattr(cls, "name", algo) != algo:
        found.append(f"{algo}: {module}: {cls.__name__}.name is {cls.name!r}, its registry key")
    form = getattr(cls, "matrix_form", None)
    if isinstance(form, type) and not issubclass(form, MatrixForm):
        found.append(f"{algo}: {module}: {cls.__name__}.matrix_form is no MatrixForm subclass")
    elif (
        isinstance(form, type)
        and declared.communication.lossy
        and form.lossy_step is MatrixForm.lossy_step
    ):
        found.append(
            f"{algo}: {_where(form)}: {form.__name__} needs `lossy_step` (its messages can be "
            "lost, so its matrix form says what a lost message does)"
        )
    line = f"{algo}: {REGISTRY}: its Declared line in _DECLARED"
    if not declared.label:
        found.append(f"{line} needs a `label` (its name in the report)")
    if not isinstance(declared.communication, Communication):
        found.append(f"{line} needs a `communication` (a Communication: how it communicates)")
    if not (isinstance(declared.options, type) and issubclass(declared.options, Options)):
        found.append(f"{line} needs `options`, an Options class (NoOptions without any)")
    return found


@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_every_algorithm_declares_everything(algo: str) -> None:
    assert missing(algo, get_algorithm_class(algo), DECLARED[algo]) == []


@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_every_algorithm_takes_its_own_default_topology(algo: str) -> None:
    cls = get_algorithm_class(algo)
    n = {"social-network": 32, "social-network-tree": 32}.get(cls.default_topology, 8)
    assert cls.topologies.refusal(algo, build(cls.default_topology, n)) is None


@pytest.mark.parametrize("test", TESTS)
def test_every_algorithm_and_relay_mode_has_rows_in_the_case_table(test: str) -> None:
    rows = cases(test)
    lacking = [a for a in ALGORITHM_NAMES if not any(c.algo == a for c in rows)]
    assert not lacking, f"tests/algorithm_cases.py: CASES has no row for {lacking} in {test!r}"
    assert {c.relay_mode for c in rows if c.algo == "relay"} == set(RELAY_MODES)


def test_a_missing_piece_is_named_with_where_it_goes() -> None:
    """An algorithm that leaves out its heal rule, its summary and its lossy step, and whose
    registry line has no label, is told each, with the file and the attribute."""

    class Plain(MatrixForm):
        def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
            return X

    class Careless(Algorithm):
        name = "careless"
        default_topology = "ring"
        topologies = get_algorithm_class("dpsgd").topologies
        matrix_form = Plain

        def step(self, x: Any, grad: Any, lr: float, step: int) -> None:
            pass

    found = missing("careless", Careless, Declared("tests:Careless", ""))
    here = "tests/test_algorithm_declarations.py"
    assert found == [
        f"careless: {here}: class Careless needs `summary` (one line for the docs' algorithm "
        "table)",
        f"careless: {here}: class Careless needs `heal_rule` (what it does over the survivors of a "
        "lost worker)",
        f"careless: {here}: Plain needs `lossy_step` (its messages can be lost, so its matrix form "
        "says what a lost message does)",
        f"careless: {REGISTRY}: its Declared line in _DECLARED needs a `label` (its name in the "
        "report)",
    ]

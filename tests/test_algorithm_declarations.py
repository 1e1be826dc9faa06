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
from relaympi.topology import TOPOLOGY_NAMES, build
from tests.algorithm_cases import TESTS, cases

REGISTRY = "relaympi/algorithms/registry.py"
ROOT = Path(__file__).resolve().parent.parent

# what its class declares: (attribute, its type, what it says)
CLASS_DECLARES = (
    ("name", str, "its --algo value, the registry's key"),
    ("summary", str, "one line for the docs' algorithm table"),
    ("topologies", Topologies, "which topologies it takes: a Topologies predicate"),
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
        and issubclass(form, MatrixForm)
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
    if declared.default_topology not in TOPOLOGY_NAMES:
        found.append(
            f"{line} needs a `default_topology` (the topology it runs on without --topology), "
            f"one of {', '.join(TOPOLOGY_NAMES)}; got {declared.default_topology!r}"
        )
    for attribute in ("default_topology", "needs_momentum"):
        if attribute in vars(cls):  # read from the registry line alone (torch-free)
            found.append(
                f"{algo}: {module}: class {cls.__name__} declares `{attribute}`; it belongs on "
                f"{line}"
            )
    return found


@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_every_algorithm_declares_everything(algo: str) -> None:
    assert missing(algo, get_algorithm_class(algo), DECLARED[algo]) == []


@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_every_algorithm_takes_its_own_default_topology(algo: str) -> None:
    cls, topology = get_algorithm_class(algo), DECLARED[algo].default_topology
    n = {"social-network": 32, "social-network-tree": 32}.get(topology, 8)
    assert cls.topologies.refusal(algo, build(topology, n)) is None


@pytest.mark.parametrize("test", TESTS)
def test_every_algorithm_and_relay_mode_has_rows_in_the_case_table(test: str) -> None:
    rows = cases(test)
    lacking = [a for a in ALGORITHM_NAMES if not any(c.algo == a for c in rows)]
    assert not lacking, f"tests/algorithm_cases.py: CASES has no row for {lacking} in {test!r}"
    assert {c.relay_mode for c in rows if c.algo == "relay"} == set(RELAY_MODES)


def test_a_missing_piece_is_named_with_where_it_goes() -> None:
    """An algorithm that leaves out its heal rule, its summary and its lossy step, whose class
    declares its default topology, and whose registry line has no label and no known default
    topology, is told each, with the file and the attribute."""

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

    found = missing("careless", Careless, Declared("tests:Careless", "", default_topology="rnig"))
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
        f"careless: {REGISTRY}: its Declared line in _DECLARED needs a `default_topology` (the "
        f"topology it runs on without --topology), one of {', '.join(TOPOLOGY_NAMES)}; got 'rnig'",
        f"careless: {here}: class Careless declares `default_topology`; it belongs on careless: "
        f"{REGISTRY}: its Declared line in _DECLARED",
    ]


@pytest.mark.parametrize("algo", ALGORITHM_NAMES)
def test_the_rules_outside_an_algorithm_follow_its_declaration(algo: str, tmp_path: Path) -> None:
    """The drop refusal, the placement identity, the checkpoints' nodes, the plan's lr warning,
    the report's label and the drop sweeps read the declaration, not the algorithm's name."""
    from jobs.sweeps import NO_DROPS
    from relaympi.config import RunConfig, experiment_settings, not_applicable
    from relaympi.report.summary import ALGO_NAMES
    from relaympi.training.checkpointing import Checkpoints
    from relaympi.training.plan import lr_may_not_suit

    declared = DECLARED[algo]
    talks = declared.communication
    refused = dict(not_applicable(RunConfig(algo=algo, drop_prob=0.5)))
    assert ("--drop-prob" in refused) is not talks.lossy
    if not talks.lossy:
        assert refused["--drop-prob"] == f"{algo} {talks.what} (nothing would be dropped)"
    assert (algo in NO_DROPS) is not talks.lossy
    placed = experiment_settings({"algo": algo, "placement": "nodes"})
    assert ("placement" in placed) is talks.placed
    checkpoints = Checkpoints(RunConfig(algo=algo), tmp_path / "r.h5", 0, 4, nodes=[0, 0, 1, 1])
    assert (checkpoints.nodes is not None) is talks.follows_nodes
    assert lr_may_not_suit(algo, 2, 16) is talks.placed and lr_may_not_suit(algo, 32, 16)
    assert ALGO_NAMES[algo] == declared.label


@pytest.mark.slow
def test_isolated_runs_on_both_engines_and_sends_nothing(tmp_path: Path) -> None:
    """The algorithm declared in its module and one registry line only: the in-process message
    passing and the batched engine give the same run, and no worker sends a byte."""
    from relaympi import train
    from relaympi.results import read_run

    runs = {}
    for backend in ("local", "batched"):
        out = tmp_path / f"{backend}.h5"
        flags = ["--task", "digits", "--backend", backend, "--workers", "4", "--algo", "isolated"]
        assert train.main([*flags, "--steps", "6", "--eval-every", "3", "--out", str(out)]) == 0
        runs[backend] = read_run(out)
    local, batched = runs["local"], runs["batched"]
    assert local.config["topology"] == "fully-connected"
    np.testing.assert_array_equal(local.data["bytes_sent"], 0)
    np.testing.assert_allclose(local.data["train_loss"], batched.data["train_loss"], atol=1e-5)
    np.testing.assert_array_equal(local.data["test_accuracy"], batched.data["test_accuracy"])

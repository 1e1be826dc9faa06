"""The API reference's docstrings kept by a test: every public function of what docs/api.md lists
says its arguments and what it returns (Google style), and the ``>>>`` examples run as written."""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the modules whose ``Example:`` blocks are doctests: cheap (no MPI, no torch, no training)
EXAMPLE_MODULES = (
    "relaympi.topology.core",
    "relaympi.topology.registry",
    "relaympi.registry",
    "relaympi.algorithms.options",
)


@pytest.mark.parametrize("name", EXAMPLE_MODULES)
def test_the_docstring_examples_run_as_written(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no >>> example left"
    assert result.failed == 0, f"{result.failed} example(s) of {name} fail (see above)"


def api_objects() -> list[tuple[str, list[str] | None]]:
    """docs/api.md's ``::: name`` directives, in page order, each with the members its
    ``members:`` option names ([] for ``false``; None: no option, every public member)."""
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    objects: list[tuple[str, list[str] | None]] = []
    for name, options in re.findall(r"^::: ([\w.]+)\n((?:[ \t]+.*\n)*)", page, re.M):
        members = re.search(r"^\s+members: (.*)$", options, re.M)
        if members is None:
            objects.append((name, None))
        elif members.group(1).strip() == "false":
            objects.append((name, []))
        else:
            objects.append((name, re.findall(r"\w+", members.group(1))))
    return objects


def _resolve(dotted: str) -> Any:
    """A module, or an attribute of the longest importable module prefix of ``dotted``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(dotted)


def _members(dotted: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """The public functions (and methods, properties aside) that the API page renders for obj."""
    if isinstance(obj, ModuleType):
        for name, value in vars(obj).items():
            if not name.startswith("_") and getattr(value, "__module__", None) == obj.__name__:
                if inspect.isfunction(value) or inspect.isclass(value):
                    yield from _members(f"{dotted}.{name}", value)
    elif inspect.isclass(obj):
        for name, value in vars(obj).items():
            if not name.startswith("_") and inspect.isfunction(value):
                yield f"{dotted}.{name}", value
            elif not name.startswith("_") and isinstance(value, (staticmethod, classmethod)):
                yield f"{dotted}.{name}", value.__func__
    elif inspect.isfunction(obj):
        yield dotted, obj


def missing_sections(function: Any) -> list[str]:
    """The Google-style sections ``function``'s docstring lacks: ``Args:`` where it takes
    arguments, ``Returns:`` where it returns something."""
    doc = inspect.getdoc(function) or ""
    signature = inspect.signature(function)
    arguments = [p for p in signature.parameters if p not in ("self", "cls")]
    returns = signature.return_annotation not in (None, "None", inspect.Signature.empty)
    missing = []
    if arguments and "Args:" not in doc:
        missing.append("Args")
    if returns and "Returns:" not in doc and "Yields:" not in doc:
        missing.append("Returns")
    return missing


def test_every_public_function_on_the_api_page_says_its_arguments_and_result() -> None:
    lacking = [
        f"{name} ({'/'.join(missing)})"
        for dotted, members in api_objects()
        for name, function in _members(dotted, _resolve(dotted))
        if members is None or name.removeprefix(dotted + ".").split(".")[0] in members
        if (missing := missing_sections(function))
    ]
    assert not lacking, "add the Google-style sections to: " + ", ".join(lacking)


def test_the_section_rule_sees_what_a_docstring_lacks() -> None:
    def bare(x: int) -> int:
        """Twice x."""
        return 2 * x

    def documented(x: int) -> None:
        """Print x.

        Args:
            x: the number.
        """

    assert ("relaympi.train", ["main"]) in api_objects()
    assert missing_sections(bare) == ["Args", "Returns"]
    assert missing_sections(documented) == []

"""Things found by name: the algorithms, tasks, engines and topologies each have one Registry.

A registry maps a name to a value, or to a reference ``"package.module:attribute"`` that is
imported the first time the name is looked up. Its names, their order and membership are known
without importing anything, so a registry of classes that need torch imports no torch until one of
them is used (the run's configuration checks names without it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


def load(reference: str) -> object:
    """The attribute that ``"package.module:attribute"`` names, its module imported."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Registry(Mapping[str, T]):
    """Name -> value, read-only, in the order given. An entry that is a string is a lazy reference
    ``"package.module:attribute"`` (so a registry never holds plain strings as values); it is
    imported on first look-up and kept. An unknown name raises ``error`` (a KeyError unless given)
    with the message ``unknown(name)``."""

    def __init__(
        self, kind: str, entries: Mapping[str, T | str], error: type[Exception] = KeyError
    ) -> None:
        self.kind = kind  # what a name names, for messages: "algorithm", "task", ...
        self.error = error
        self._entries: dict[str, T | str] = dict(entries)

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise self.error(self.unknown(name))
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = self._entries[name] = load(entry)  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:  # without loading anything
        return name in self._entries

    def get(self, name: str, default: T | None = None) -> T | None:  # type: ignore[override]
        """The value of ``name``, loaded on first look-up, or ``default`` for an unknown name.

        Args:
            name: the name to look up.
            default: what an unknown name gives.

        Returns:
            The value, or ``default``.

        Example:
            >>> colours = Registry("colour", {"red": 1, "blue": 2})
            >>> colours.get("red"), colours.get("green"), "green" in colours
            (1, None, False)
        """
        return self[name] if name in self._entries else default

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def unknown(self, name: object) -> str:
        """The message of an unknown name: what it is and the names to choose from.

        Args:
            name: the name that was not found.

        Returns:
            One line, as the registry's ``error`` carries it.

        Example:
            >>> Registry("colour", {"red": 1, "blue": 2}).unknown("green")
            "unknown colour 'green'; choose one of red, blue"
        """
        return f"unknown {self.kind} {name!r}; choose one of {', '.join(self._entries)}"

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

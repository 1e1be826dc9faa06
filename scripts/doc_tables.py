"""Writes the tables in docs/ that are made from the code: the flags, the algorithms and their heal
rules. Run from the repository root after changing a flag, an algorithm's declaration or a heal
rule::

    python -m scripts.doc_tables           # rewrite every stale table in place
    python -m scripts.doc_tables --check   # only name the stale ones (exit 1 if any)

The tests compare each page with its table and name this command when one differs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from relaympi.entrypoint import UsageParser

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m scripts.doc_tables"


def _flags() -> str:
    from relaympi.config import flag_table

    return flag_table()


def _algorithms() -> str:
    from relaympi.algorithms.registry import algorithm_table

    return algorithm_table()


def _heal_rules() -> str:
    from relaympi.training.membership import heal_table

    return heal_table()


@dataclass(frozen=True)
class DocTable:
    """One generated table: the page it is on, its first line (which finds it there; it runs to
    the first blank line) and the function that makes it."""

    page: str
    header: str
    make: Callable[[], str]

    def _span(self, text: str) -> tuple[int, int]:
        start = text.find(self.header)
        if start < 0:
            raise ValueError(f"{self.page} has no table starting {self.header!r}")
        end = text.find("\n\n", start)
        return start, len(text) if end < 0 else end

    def written(self, root: Path | None = None) -> str:
        """The table as the page under ``root`` (the repository's by default) has it now."""
        text = ((root or ROOT) / self.page).read_text(encoding="utf-8")
        start, end = self._span(text)
        return text[start:end]

    def generated(self) -> str:
        """The table as the code makes it."""
        return self.make().rstrip("\n")

    def write(self, root: Path | None = None) -> None:
        """Put the generated table over the page's (under ``root``, the repository's by
        default)."""
        path = (root or ROOT) / self.page
        text = path.read_text(encoding="utf-8")
        start, end = self._span(text)
        path.write_text(text[:start] + self.generated() + text[end:], encoding="utf-8")


TABLES = (
    DocTable("docs/running.md", "| flag | meaning (default) |", _flags),
    DocTable("docs/algorithms.md", "| `--algo` | what |", _algorithms),
    DocTable("docs/membership.md", "| algorithm | over the survivors |", _heal_rules),
)


def stale(root: Path | None = None) -> list[DocTable]:
    """The tables whose page (under ``root``, by default the repository's) differs from the
    code."""
    return [table for table in TABLES if table.written(root or ROOT) != table.generated()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = UsageParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only name the stale tables")
    args = parser.parse_args(argv)
    old = stale()
    for table in old:
        if args.check:
            print(f"{table.page}: its table differs from the code", file=sys.stderr)
        else:
            table.write(ROOT)
            print(f"wrote {table.page}")
    return 1 if args.check and old else 0


if __name__ == "__main__":
    sys.exit(main())

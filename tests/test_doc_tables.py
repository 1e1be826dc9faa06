"""The tables in docs/ made from the code (the flags, the algorithms, their heal rules) are the
code's, and one command writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import doc_tables
from scripts.doc_tables import COMMAND, TABLES, DocTable


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.page)
def test_each_generated_table_in_the_docs_is_the_codes(table: DocTable) -> None:
    assert table.written() == table.generated(), (
        f"{table.page}'s table starting {table.header!r} differs from the code: run `{COMMAND}`"
    )


def test_the_command_rewrites_a_stale_table_and_check_names_it(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\n| a | b |\n| --- | --- |\n| old | row |\n\nAfter.\n")
    table = DocTable("docs/page.md", "| a | b |", lambda: "| a | b |\n| --- | --- |\n| new | 1 |\n")
    monkeypatch.setattr(doc_tables, "TABLES", (table,))
    monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
    assert doc_tables.main(["--check"]) == 1
    assert "docs/page.md" in capsys.readouterr().err
    assert doc_tables.main([]) == 0
    assert page.read_text() == "# Page\n\n| a | b |\n| --- | --- |\n| new | 1 |\n\nAfter.\n"
    assert doc_tables.main(["--check"]) == 0


def test_the_command_is_the_one_the_docs_name() -> None:
    contributing = (Path(doc_tables.ROOT) / "docs" / "contributing.md").read_text()
    assert f"`{COMMAND}`" in contributing

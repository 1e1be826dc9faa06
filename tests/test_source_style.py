"""Style the formatters do not keep: no comment split so that a single word sits on a line of its
own."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("relaympi", "benchmarks", "jobs", "scripts", "tests")


def orphaned_words(source: str) -> list[int]:
    """The line numbers of comment lines that hold one word and follow another comment line: what a
    wrap at a fixed width leaves behind ("# into", "# node)").

    Args:
        source: the text of a Python module.

    Returns:
        The 1-based line numbers, in order (comments inside strings are not comments).
    """
    alone = {}  # line number -> the comment, for lines that hold nothing else
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and not token.line[: token.start[1]].strip():
            alone[token.start[0]] = token.string
    return [
        line
        for line, comment in sorted(alone.items())
        if line - 1 in alone and len(comment.lstrip("#").split()) == 1
    ]


def test_no_comment_leaves_one_word_on_a_line_of_its_own() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for line in orphaned_words(path.read_text(encoding="utf-8"))
    ]
    assert not found, "a one-word comment line continues the comment above; reflow it: " + (
        ", ".join(found)
    )


def test_the_rule_finds_a_split_comment_and_nothing_else() -> None:
    split = "x = 1\n# the step's timers then split\n# into\n# compute and comm\ny = 2\n"
    assert orphaned_words(split) == [3]
    fine = (
        "# one word on its own after code is a heading, not a split\n"
        "x = 1\n"
        "# TODO\n"
        "y = 2  # a\n"
        "# b\n"  # after a trailing comment: the line above holds code
        's = """\n# not\n# comments\n"""\n'
        "# -- a section --------------------------------------------------------------\n"
        "# two words\n"
    )
    assert orphaned_words(fine) == []


# not yet held to this rule: these packages still hold a few dangling comments, left while their
# modules are being changed on other branches (move them, then drop the package from here)
DANGLING_LATER = ("relaympi/comm", "relaympi/engines", "relaympi/training")


def dangling_comments(source: str) -> list[int]:
    """The line numbers of comments that trail a line holding only closing brackets (`)  # why`):
    what a formatter leaves when it splits a statement whose comment made it too long, so that the
    comment sits below the code it explains. It belongs above the statement or beside its argument.

    Args:
        source: the text of a Python module.

    Returns:
        The 1-based line numbers, in order; a formatter's own `# fmt: skip` is not counted.
    """
    tokens = [
        token
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    found = []
    for before, token in zip(tokens, tokens[1:], strict=False):
        if token.type != tokenize.COMMENT or token.string.lstrip("# ").startswith("fmt:"):
            continue
        code = token.line[: token.start[1]].strip()
        if code and before.start[0] == token.start[0] and not code.strip(")]}:,").strip():
            found.append(token.start[0])
    return found


def test_no_comment_dangles_after_closing_brackets() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(DANGLING_LATER)
        for line in dangling_comments(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "a comment after a line of closing brackets explains the code above it; put it above the "
        "statement or beside the argument it is about: " + ", ".join(found)
    )


def test_the_dangling_rule_finds_a_comment_after_brackets_and_nothing_else() -> None:
    dangling = "x = f(\n    a,\n)  # why a\nif (\n    x\n):  # why x\n    pass\n"
    assert dangling_comments(dangling) == [3, 6]
    fine = (
        "# why a\n"
        "x = f(a)  # why f\n"
        "y = g(\n"
        "    a,  # why a\n"
        ")\n"
        "z = [\n"
        "    1,\n"
        "]  # fmt: skip\n"
        "    # an indented comment alone\n"
        's = """\n)  # not a comment\n"""\n'
    )
    assert dangling_comments(fine) == []

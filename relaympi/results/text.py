"""Strings from run files shown as data: no control character (line break, terminal escape,
bidirectional override) reaches a console or a line-based output format through them."""

from __future__ import annotations

# C0 (newlines, ESC, ...), DEL and C1 (CSI, NEL, ...), the Unicode line and paragraph separators,
# and the bidirectional controls that reorder what a terminal or editor shows
_CONTROLS = (
    *range(0x00, 0x20),
    *range(0x7F, 0xA0),
    0x2028,
    0x2029,
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
)
_ONE_LINE = {code: " " for code in _CONTROLS}
_CONSOLE = {code: None for code in _CONTROLS if chr(code) not in "\n\t"}


def one_line(text: str) -> str:
    """``text`` on one line: each control character becomes a space.

    Args:
        text: any string, e.g. a config value, a provenance field or a file name from a run file.

    Returns:
        The string without line breaks, terminal escapes or bidirectional controls, for a line of
        a line-based format (a LaTeX comment, a CSV comment, a text table's cell).
    """
    return text.translate(_ONE_LINE)


def console(text: str) -> str:
    """``text`` safe to print to a terminal: control characters removed, except the newlines
    and tabs that lay it out.

    Args:
        text: what a command prints, run-file strings included.

    Returns:
        The text without terminal escape sequences' introducers, carriage returns or other
        control characters.
    """
    return text.translate(_CONSOLE)

"""Run a command-line main: exit with its status, quietly when the reader of stdout went away."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from relaympi.launcher import launch

EXIT_USAGE = 2


def run(main: Callable[[], int | None]) -> NoReturn:
    """sys.exit(main()); `... | head` closing the pipe early ends the program quietly with 0."""
    try:
        status = main()
        sys.stdout.flush()  # inside the try: a closed pipe would otherwise fail at interpreter exit
    except BrokenPipeError:
        # the output that was wanted is out; point stdout at /dev/null so the final flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)


def launcher_rank() -> int:
    """This process's rank as mpirun/mpiexec/srun announce it (0 when started otherwise).

    Read before MPI starts, so a usage error can be printed by rank 0 alone.
    """
    return launch().rank


class UsageParser(argparse.ArgumentParser):
    """argparse for relaympi's commands: misuse prints one line to stderr and exits 2: the reason,
    a "did you mean" where a mistyped flag, choice or subcommand is close to a real one, and the
    command that shows the usage (not the usage itself: dozens of lines that bury the reason).
    Under mpirun only rank 0 prints (every rank parses the same flags)."""

    def error(self, message: str) -> NoReturn:
        if launcher_rank() != 0:
            self.exit(EXIT_USAGE)
        guess = self._close_name(message)
        hint = f"; did you mean {guess}?" if guess else ""
        help_hint = f" (see `{self.prog} --help`)" if self.add_help else ""
        self.exit(EXIT_USAGE, f"error: {message}{hint}{help_hint}\n")

    def _close_name(self, message: str) -> str | None:
        """The real name closest to the mistyped one ``message`` reports, or None."""
        choice = _INVALID_CHOICE.search(message)
        if choice:
            value, choices = choice.group("value"), choice.group("choices")
            names = [name.strip().strip("'\"") for name in choices.split(",")]
            match = difflib.get_close_matches(value.strip("'\""), names, n=1)
            return f"'{match[0]}'" if match else None
        unknown = _UNRECOGNIZED.match(message)
        if unknown:
            flags = sorted(self._option_strings())
            for word in unknown.group("words").split():
                if word.startswith("--"):
                    flag = _close_flag(word.split("=", 1)[0], flags)
                    if flag:
                        return flag
        return None

    def _option_strings(self) -> set[str]:
        """Every long option of this parser and of its subcommands' parsers."""
        names = {name for name in self._option_string_actions if name.startswith("--")}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    names |= parser._option_strings() if isinstance(parser, UsageParser) else set()
        return names


def _close_flag(word: str, flags: list[str]) -> str | None:
    """The flag among ``flags`` closest to the mistyped ``word``, or None: a whole name, else one
    whose start is close to it (argparse takes a flag's start, so `--targt` is a slip of
    `--target-accuracy`; a start as long as the word, and a word of at least `--` and 4 letters,
    so that short junk guesses nothing).

    Args:
        word: the unrecognized flag, without any ``=value``.
        flags: the parser's long flags.

    Returns:
        The flag to suggest, or None where none is close.
    """
    match = difflib.get_close_matches(word, flags, n=1)
    if match:
        return match[0]
    if len(word) < 6:
        return None
    starts: dict[str, list[str]] = {}
    for flag in flags:
        if len(flag) > len(word):
            starts.setdefault(flag[: len(word)], []).append(flag)
    # a start that two flags share names neither
    unique = [start for start, named in starts.items() if len(named) == 1]
    match = difflib.get_close_matches(word, unique, n=1, cutoff=0.8)
    return starts[match[0]][0] if match else None


# argparse's messages (Python 3.10 to 3.13): choices are quoted before 3.12.8, bare since
_INVALID_CHOICE = re.compile(r"invalid choice: (?P<value>.+?) \(choose from (?P<choices>.+)\)$")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<words>.+)$")

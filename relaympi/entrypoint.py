"""Run a command-line main: exit with its status, quietly when the reader of stdout went away."""

from __future__ import annotations

import argparse
import os
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
    """argparse for relaympi's commands: misuse prints the usage and a one-line reason to stderr
    and exits 2; under mpirun only rank 0 prints (every rank parses the same flags)."""

    def error(self, message: str) -> NoReturn:
        if launcher_rank() != 0:
            self.exit(EXIT_USAGE)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n")

"""Entry point of `python -m relaympi.topology`."""

from relaympi.entrypoint import run

from .cli import main

run(main)

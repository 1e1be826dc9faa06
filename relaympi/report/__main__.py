"""Entry point of `python -m relaympi.report`."""

from relaympi.entrypoint import run
from relaympi.report.cli import main

run(main)

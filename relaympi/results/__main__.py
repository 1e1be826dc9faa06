"""`python -m relaympi.results status|show ...`."""

from relaympi.entrypoint import run
from relaympi.results.cli import main

run(main)

"""Entry point of `python -m relaympi.topology` (the command line: relaympi/commands/topology.py)."""

from relaympi.commands.topology import main
from relaympi.entrypoint import run

run(main)

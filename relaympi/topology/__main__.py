"""Entry point of `python -m relaympi.topology`: see relaympi/commands/topology.py."""

from relaympi.commands.topology import main
from relaympi.entrypoint import run

run(main)

"""`python -m relaympi.data`: see relaympi/commands/data.py."""

from relaympi.commands.data import main
from relaympi.entrypoint import run

run(main)

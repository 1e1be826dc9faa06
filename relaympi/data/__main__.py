"""`python -m relaympi.data`: see relaympi/data/cli.py."""

from relaympi.data.cli import main
from relaympi.entrypoint import run

run(main)

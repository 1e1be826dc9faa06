"""Entry point of `python -m relaympi.topology`."""

from .cli import main

raise SystemExit(main())

"""`python -m relaympi.data`: see relaympi/data/cli.py."""

import sys

from relaympi.data.cli import main

sys.exit(main())

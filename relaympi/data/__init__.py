"""Data sets: the default data root, fetching with checksums, checking, and the ImageNet layout.

    python -m relaympi.data fetch cifar10 agnews distilbert [--root DIR] [--url URL]
    python -m relaympi.data check [NAME ...]
    python -m relaympi.data prepare-imagenet --train TAR --val TAR --devkit FILE [--link|--move]

The trainer reads ``<root>/<task>`` (and ``<root>/distilbert`` for agnews) when no
``--data-dir`` / ``--model-dir`` is given; the root is ``$RELAYMPI_DATA`` or ``~/.cache/relaympi``.
"""

from relaympi.data.download import ChecksumError, DataError, OfflineError
from relaympi.data.paths import data_root, fetch_command, set_dir, task_dirs, task_sets

__all__ = [
    "ChecksumError",
    "DataError",
    "OfflineError",
    "data_root",
    "fetch_command",
    "set_dir",
    "task_dirs",
    "task_sets",
]

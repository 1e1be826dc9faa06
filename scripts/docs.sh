#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml, docs/) strictly into site/ (git-ignored): a broken
# link or anchor, a page missing from the nav or a nav entry without its page, and an API
# reference that names nothing all fail the build (exit 1).
#   bash scripts/docs.sh            build into site/
#   bash scripts/docs.sh serve      preview at http://127.0.0.1:8000 while editing
# Needs the docs extra: `bash scripts/setup.sh` installs it (pip install -e ".[docs]").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner, printed on every build
if ! "$PYTHON" -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "docs: mkdocs, mkdocs-material or mkdocstrings-python is missing; run bash scripts/setup.sh" >&2
  exit 1
fi
if [ "${1:-}" = "serve" ]; then
  exec "$PYTHON" -m mkdocs serve --strict
fi
"$PYTHON" -m mkdocs build --strict --clean --site-dir site
echo "docs: built site/index.html" >&2

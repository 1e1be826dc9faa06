#!/usr/bin/env bash
# The style checks: ruff's lint rules, ruff's formatting and mypy's types (configured in
# pyproject.toml). Every check runs; the exit status is non-zero if any of them found something.
# Uses the tools of .venv (bash scripts/setup.sh installs them with the test extra).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
for tool in ruff mypy; do
  if [ ! -x "$BIN/$tool" ]; then
    echo "lint: $BIN/$tool is missing; run bash scripts/setup.sh first" >&2
    exit 2
  fi
done
# every Python tree of the repository (the Markdown pages' code blocks are examples, not checked)
PATHS=(relaympi benchmarks jobs scripts tests)
status=0
run() {
  echo "lint: $*" >&2
  "$@" || status=1
}
run "$BIN/ruff" check "${PATHS[@]}"
run "$BIN/ruff" format --check "${PATHS[@]}"
run "$BIN/mypy"
if [ "$status" -ne 0 ]; then
  echo "lint: failed (see above)" >&2
fi
exit "$status"

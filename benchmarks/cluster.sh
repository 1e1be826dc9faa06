#!/usr/bin/env bash
# python -m benchmarks.comm on an emulated cluster on this machine: N nodes x K ranks, every node's
# link shaped to RATE (cluster/local_cluster.sh start --nodes N --link RATE), ranks started in the
# nodes' namespaces with mpiexec's rsh launcher; the cluster is stopped (namespaces, links,
# daemons) when the run ends. Root, Linux, SLURM installed (cluster/local_cluster.sh install).
#
#   sudo bash benchmarks/cluster.sh --nodes 4 --ranks-per-node 1 --link 1gbit
#   sudo bash benchmarks/cluster.sh --nodes 2 --ranks-per-node 2 --link 1gbit -- --sizes 2300000 --reps 5
#
# Options: --nodes N (4), --ranks-per-node K (1), --link RATE (1gbit; 'none': unshaped),
# --dir DIR (the cluster's folder; a fresh one under /tmp). After `--`: options of
# benchmarks.comm (default --sizes 2300000 --reps 5 --out bench-results/cluster-NxK-RATE.h5).
# Prints the table and the bytes node1's link carried each way. Figures are relative: an
# emulator on one machine (all ranks share its cores and memory), links without latency or loss.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "cluster.sh: $*" >&2; echo "usage: $0 [--nodes N] [--ranks-per-node K] [--link RATE] [--dir DIR] [-- benchmarks.comm options]" >&2; exit 2; }
NODES=4 PER_NODE=1 LINK=1gbit DIR=""
while (($#)); do
    case "$1" in
        --) shift; break ;;
        --nodes|--ranks-per-node|--link|--dir) [[ $# -ge 2 ]] || usage "$1 needs a value" ;;&
        --nodes) NODES="$2"; shift 2 ;;
        --ranks-per-node) PER_NODE="$2"; shift 2 ;;
        --link) LINK="$2"; shift 2 ;;
        --dir) DIR="$2"; shift 2 ;;
        *) usage "unknown option $1" ;;
    esac
done
[[ "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 2 ]] || usage "--nodes must be a number >= 2, got '$NODES'"
[[ "$PER_NODE" =~ ^[0-9]+$ && "$PER_NODE" -ge 1 ]] || usage "--ranks-per-node must be a positive number, got '$PER_NODE'"
COMM_ARGS=("$@")
((${#COMM_ARGS[@]})) || COMM_ARGS=(--sizes 2300000 --reps 5)
[[ " ${COMM_ARGS[*]} " == *" --out "* ]] || COMM_ARGS+=(--out "bench-results/cluster-${NODES}x${PER_NODE}-${LINK}.h5")
PY="${RELAYMPI_PYTHON:-}"
[[ -n "$PY" ]] || { [[ -x .venv/bin/python ]] && PY="$PWD/.venv/bin/python"; } || PY="$(command -v python3)"
MPIEXEC="$(dirname "$PY")/mpiexec"
[[ -x "$MPIEXEC" ]] || MPIEXEC="$(command -v mpiexec)" || { echo "cluster.sh: no mpiexec next to $PY or on PATH" >&2; exit 2; }
[[ -n "$DIR" ]] || DIR="$(mktemp -d /tmp/relaympi-bench-cluster.XXXXXX)/cluster"

exports="$(bash cluster/local_cluster.sh start --nodes "$NODES" --link "$LINK" --cpus-per-node "$PER_NODE" --dir "$DIR")"
trap 'bash cluster/local_cluster.sh stop --dir "$DIR" || true; rmdir "$(dirname "$DIR")" 2>/dev/null || true' EXIT
eval "$exports"
# shellcheck disable=SC1091
source "$DIR/nodes.env"
sent() {  # bytes through node1's tbf qdiscs: into the node, out of it (0 0 when unshaped: no counters)
    tc -s qdisc show dev "rmpi${N_TAG}n1" | awk '/Sent/ && !n++ { s = $2 } END { printf "%.0f\n", s }'
    tc -n "rmpi$N_TAG-node1" -s qdisc show dev "$N_IFACE" | awk '/Sent/ && !n++ { s = $2 } END { printf "%.0f\n", s }'
}
mapfile -t before < <(sent)
echo "cluster.sh: $NODES nodes x $PER_NODE ranks, links $LINK: $MPIEXEC -launcher rsh -launcher-exec $RELAYMPI_CLUSTER_LAUNCHER -f $RELAYMPI_CLUSTER_HOSTS -ppn $PER_NODE -n $((NODES * PER_NODE)) python -m benchmarks.comm ${COMM_ARGS[*]}" >&2
mkdir -p bench-results
OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$MPIEXEC" -launcher rsh -launcher-exec "$RELAYMPI_CLUSTER_LAUNCHER" \
    -f "$RELAYMPI_CLUSTER_HOSTS" -ppn "$PER_NODE" -n $((NODES * PER_NODE)) "$PY" -m benchmarks.comm "${COMM_ARGS[@]}"
mapfile -t after < <(sent)
echo "node1's link carried $(((after[0] - before[0]) / 1000000)) MB in, $(((after[1] - before[1]) / 1000000)) MB out (tbf counters; links $LINK)"

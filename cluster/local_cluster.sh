#!/usr/bin/env bash
# The cluster tool: a SLURM cluster on this machine, for trying sweeps on a laptop or in CI. It
# comes in two kinds, each in its own file, that this entry point sources and dispatches to:
#
#   cluster/slurm.sh   one node (localhost): install SLURM and munge, start, stop and show an
#                      instance; also the slurm.conf lines and daemons both kinds share
#   cluster/nodes.sh   N emulated nodes (--nodes N): one network namespace and hostname each,
#                      links shaped with tc, a slurmd per node
#
# `cluster/local_cluster.sh --help` prints the commands and options (their text: show_help below).
set -euo pipefail

CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cluster/slurm.sh
source "$CLUSTER_DIR/slurm.sh"
# shellcheck source=cluster/nodes.sh
source "$CLUSTER_DIR/nodes.sh"

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
usage() { echo "local_cluster.sh: $*" >&2; echo "usage: $0 {install|start|stop|status|link RATE|help} [--dir DIR] [--ctld-port PORT] [--slurmd-port PORT] [--partition NAME] [--nodes N] [--link RATE] [--subnet A.B.C] [--cpus-per-node N]" >&2; exit 2; }

show_help() {
    cat <<EOF
usage: $0 {install|start|stop|status|link RATE|help} [options]

A SLURM cluster on this machine, for trying sweeps on a laptop or in CI: one node (localhost),
or N emulated nodes (--nodes N).

  sudo bash cluster/local_cluster.sh install   # Debian/Ubuntu: slurmctld slurmd slurm-client munge
  sudo bash cluster/local_cluster.sh start     # then: export SLURM_CONF=... (printed)
  bash cluster/local_cluster.sh status
  sudo bash cluster/local_cluster.sh stop
  bash cluster/local_cluster.sh --help         # this text (also -h, help)

Several can run side by side (beside any other SLURM on the machine): each instance is its
folder, and start, status and stop act on the instance of the folder they are given:

  --dir DIR           state, logs and slurm.conf (RELAYMPI_SLURM_DIR; /run/relaympi-slurm, with
                      --nodes /run/relaympi-nodes): made 0700 if missing; refused (exit 2) if
                      it, or a folder above it, is another user's or others may write to it
  --ctld-port PORT    slurmctld's port (RELAYMPI_SLURM_CTLD_PORT)
  --slurmd-port PORT  slurmd's port (RELAYMPI_SLURMD_PORT)
  --partition NAME    the one partition (RELAYMPI_SLURM_PARTITION; debug)

Emulated nodes (a cluster of N hosts on this machine; Linux, root, iproute2 and util-linux):

  --nodes N           N nodes node1..nodeN (RELAYMPI_SLURM_NODES): one network namespace and one
                      hostname (UTS namespace) each, a veth pair to a bridge, a slurmd each
  --link RATE         shape every node's link to RATE in both directions with tc tbf
                      (RELAYMPI_SLURM_LINK; e.g. 1gbit, 100mbit; 'none': unshaped, the default)
  --subnet A.B.C      the private /24 the nodes live in (RELAYMPI_SLURM_SUBNET; the first free
                      of 10.213.7, 10.213.8, ...): the bridge is A.B.C.1, nodeI is A.B.C.(10+I)
  --cpus-per-node N   CPUs each node offers SLURM (RELAYMPI_SLURM_CPUS_PER_NODE; nproc)

  sudo bash cluster/local_cluster.sh start --nodes 2 --link 1gbit
      # prints the exports for SLURM and MPI; eval them (RELAYMPI_SLURM_DIR then points
      # link, status and stop at this cluster)
  sudo bash cluster/local_cluster.sh link 100mbit   # change a running cluster's links
  sudo bash cluster/local_cluster.sh stop           # namespaces, links, daemons, files

Traffic stays inside the nodes' /24: no route, NAT or default route leads out of it.

Without ports, start takes SLURM's own 6817/6818 where they are free, else the next free pair
above them, and writes them into DIR/slurm.conf (start on a running instance keeps its conf).
The system's own /etc/slurm is never touched. Needs root (munged runs as user munge); one
munged serves every instance, and the stop that leaves no SLURM daemon running stops it if an
instance's start started it.
EOF
}

parse_options() {
    SLURM_DIR="${RELAYMPI_SLURM_DIR:-}"
    CTLD_PORT="${RELAYMPI_SLURM_CTLD_PORT:-}"
    SLURMD_PORT="${RELAYMPI_SLURMD_PORT:-}"
    PARTITION="${RELAYMPI_SLURM_PARTITION:-debug}"
    NODES="${RELAYMPI_SLURM_NODES:-}"
    LINK="${RELAYMPI_SLURM_LINK:-}"
    SUBNET="${RELAYMPI_SLURM_SUBNET:-}"
    CPUS_PER_NODE="${RELAYMPI_SLURM_CPUS_PER_NODE:-}"
    while (($#)); do
        [[ $# -ge 2 ]] || usage "$1 needs a value"
        case "$1" in
            --dir) SLURM_DIR="$2" ;;
            --ctld-port) CTLD_PORT="$2" ;;
            --slurmd-port) SLURMD_PORT="$2" ;;
            --partition) PARTITION="$2" ;;
            --nodes) NODES="$2" ;;
            --link) LINK="$2" ;;
            --subnet) SUBNET="$2" ;;
            --cpus-per-node) CPUS_PER_NODE="$2" ;;
            *) usage "unknown option $1" ;;
        esac
        shift 2
    done
    # emulated nodes default to their own folder, beside a one-node cluster in the default one
    # in /run, where only root makes folders: no one else can make it first (as in /tmp)
    [[ -n "$SLURM_DIR" ]] || { [[ -n "$NODES" ]] && SLURM_DIR=/run/relaympi-nodes; } || SLURM_DIR=/run/relaympi-slurm
    [[ -n "$SLURM_DIR" && "$SLURM_DIR" != *[\"$'\n']* ]] || usage "--dir must be a folder name without quotes or newlines, got '$SLURM_DIR'"
    [[ "$SLURM_DIR" == /* ]] || SLURM_DIR="$PWD/$SLURM_DIR"  # the conf names it; daemons run elsewhere
    local port
    for port in "$CTLD_PORT" "$SLURMD_PORT"; do
        [[ -z "$port" || ( "$port" =~ ^[0-9]+$ && "$port" -ge 1024 && "$port" -le 65535 ) ]] \
            || usage "a port must be a number in 1024-65535, got '$port'"
    done
    [[ -z "$CTLD_PORT" || "$CTLD_PORT" != "$SLURMD_PORT" ]] || usage "--ctld-port and --slurmd-port must differ, both are $CTLD_PORT"
    [[ "$PARTITION" =~ ^[A-Za-z0-9_-]+$ ]] || usage "--partition must be letters, digits, _ or -, got '$PARTITION'"
    [[ -z "$NODES" || ( "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 1 && "$NODES" -le 64 ) ]] || usage "--nodes must be a number in 1-64, got '$NODES'"
    [[ -z "$LINK" ]] || link_rate_bits "$LINK" >/dev/null || usage "--link must be a tc rate such as 1gbit, 100mbit, 500kbit or 'none', got '$LINK'"
    [[ -z "$SUBNET" ]] || valid_subnet "$SUBNET" || usage "--subnet must be the first three numbers of a private /24 (10.x.y, 172.16-31.y, 192.168.y), e.g. 10.213.7, got '$SUBNET'"
    [[ -z "$CPUS_PER_NODE" || ( "$CPUS_PER_NODE" =~ ^[0-9]+$ && "$CPUS_PER_NODE" -ge 1 ) ]] || usage "--cpus-per-node must be a positive number, got '$CPUS_PER_NODE'"
    CONF="$SLURM_DIR/slurm.conf"
    NODES_ENV="$SLURM_DIR/nodes.env"  # an emulated-nodes instance: what stop must remove
}

command="${1:-}"
case "$command" in help | -h | --help) show_help; exit 0 ;; esac
for arg in "$@"; do  # -h/--help after a command or option: the help too, before any check
    case "$arg" in -h | --help) show_help; exit 0 ;; esac
done
if (($#)); then shift; fi
if [[ "$command" == link ]]; then
    [[ $# -ge 1 && "$1" != --* ]] || usage "link needs a RATE (e.g. 1gbit, 100mbit, none)"
    set -- --link "$@"
fi
parse_options "$@"
# root first (its one line), then the state folder, checked before anything in it is read
case "$command" in
    install) install ;;
    start)
        if [[ -n "$NODES" ]]; then need_nodes start; else need_root start; fi
        open_state_dir create
        if [[ -n "$NODES" ]] || load_nodes; then nodes_start; else start; fi
        ;;
    stop)
        need_root stop
        open_state_dir existing
        if [[ -s "$NODES_ENV" ]]; then nodes_stop; stop_munge; echo "SLURM stopped, nodes removed ($SLURM_DIR)" >&2; else stop; fi
        ;;
    status) open_state_dir existing; if load_nodes; then nodes_status; else status; fi ;;
    link) need_nodes link; open_state_dir existing; nodes_link ;;
    *) usage "unknown command '$command'" ;;
esac

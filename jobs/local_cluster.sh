#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying sweeps on a laptop or in CI.
#
#   sudo bash jobs/local_cluster.sh install   # Debian/Ubuntu: slurmctld slurmd slurm-client munge
#   sudo bash jobs/local_cluster.sh start     # then: export SLURM_CONF=... (printed)
#   bash jobs/local_cluster.sh status
#   sudo bash jobs/local_cluster.sh stop
#
# Several can run side by side (beside any other SLURM on the machine): each instance is its
# folder, and start, status and stop act on the instance of the folder they are given:
#
#   --dir DIR           state, logs and slurm.conf (RELAYMPI_SLURM_DIR; /tmp/relaympi-slurm, with --nodes
#                       /tmp/relaympi-nodes)
#   --ctld-port PORT    slurmctld's port (RELAYMPI_SLURM_CTLD_PORT)
#   --slurmd-port PORT  slurmd's port (RELAYMPI_SLURMD_PORT)
#   --partition NAME    the one partition (RELAYMPI_SLURM_PARTITION; debug)
#
# Emulated nodes (a cluster of N hosts on this machine; Linux, root, iproute2 and util-linux):
#
#   --nodes N           N nodes node1..nodeN (RELAYMPI_SLURM_NODES): one network namespace and one
#                       hostname (UTS namespace) each, a veth pair to a bridge, a slurmd each
#   --link RATE         shape every node's link to RATE in both directions with tc tbf
#                       (RELAYMPI_SLURM_LINK; e.g. 1gbit, 100mbit; 'none': unshaped, the default)
#   --subnet A.B.C      the private /24 the nodes live in (RELAYMPI_SLURM_SUBNET; the first free
#                       of 10.213.7, 10.213.8, ...): the bridge is A.B.C.1, nodeI is A.B.C.(10+I)
#   --cpus-per-node N   CPUs each node offers SLURM (RELAYMPI_SLURM_CPUS_PER_NODE; nproc)
#
#   sudo bash jobs/local_cluster.sh start --nodes 2 --link 1gbit   # prints the exports for SLURM and MPI (eval them:
#                                                                   # RELAYMPI_SLURM_DIR points link/status/stop at it)
#   sudo bash jobs/local_cluster.sh link 100mbit                  # change a running cluster's links
#   sudo bash jobs/local_cluster.sh stop                          # namespaces, links, daemons, files
#
# Traffic stays inside the nodes' /24: no route, NAT or default route leads out of it.
#
# Without ports, start takes SLURM's own 6817/6818 where they are free, else the next free
# pair above them, and writes them into DIR/slurm.conf (start on a running instance keeps its
# conf). The system's own /etc/slurm is never touched. Needs root (munged runs as user munge);
# one munged serves every instance, and the stop that leaves no SLURM daemon running stops it
# if an instance's start started it.
set -euo pipefail

MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN=/run/munge
MUNGED_OURS=/run/relaympi-local-cluster.munged  # pid of the munged that a start started

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
usage() { echo "local_cluster.sh: $*" >&2; echo "usage: $0 {install|start|stop|status|link RATE} [--dir DIR] [--ctld-port PORT] [--slurmd-port PORT] [--partition NAME] [--nodes N] [--link RATE] [--subnet A.B.C] [--cpus-per-node N]" >&2; exit 2; }

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
    [[ -n "$SLURM_DIR" ]] || { [[ -n "$NODES" ]] && SLURM_DIR=/tmp/relaympi-nodes; } || SLURM_DIR=/tmp/relaympi-slurm
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

link_rate_bits() {  # RATE: its bits per second (tc's units), or fail; 'none' is 0 (unshaped)
    local rate="${1,,}" number unit
    [[ "$rate" == none || "$rate" == unlimited ]] && { echo 0; return; }
    [[ "$rate" =~ ^([0-9]+)(kbit|mbit|gbit|bit|kbps|mbps|gbps|bps)$ ]] || return 1
    number="${BASH_REMATCH[1]}" unit="${BASH_REMATCH[2]}"
    [[ "$number" -ge 1 && "${#number}" -le 6 ]] || return 1
    case "$unit" in
        bit) echo "$number" ;; kbit) echo $((number * 1000)) ;; mbit) echo $((number * 1000000)) ;; gbit) echo $((number * 1000000000)) ;;
        bps) echo $((number * 8)) ;; kbps) echo $((number * 8000)) ;; mbps) echo $((number * 8000000)) ;; gbps) echo $((number * 8000000000)) ;;
    esac
}

valid_subnet() {  # A.B.C: a private /24 prefix
    [[ "$1" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
    local a="${BASH_REMATCH[1]}" b="${BASH_REMATCH[2]}" c="${BASH_REMATCH[3]}"
    ((b <= 255 && c <= 255)) || return 1
    ((a == 10)) || ((a == 172 && b >= 16 && b <= 31)) || ((a == 192 && b == 168))
}

need_root() {
    [[ "$(id -u)" == 0 ]] || die "'$1' needs root (try: sudo bash $0 $1)"
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        echo "SLURM and munge are already installed: $(slurmctld -V)"
        return
    fi
    need_root install
    command -v apt-get >/dev/null || die "install needs apt-get (Debian/Ubuntu); install SLURM and munge by hand"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
    echo "installed: $(slurmctld -V)"
}

port_in_use() {  # PORT: bound by a TCP socket on this machine (IPv4 or IPv6); TIME_WAIT (06) does not stop
    local hex      # SLURM's daemons, which bind with SO_REUSEADDR
    hex="$(printf ':%04X' "$1")"
    awk -v hex="$hex" 'FNR > 1 && $4 != "06" && substr($2, length($2) - 4) == hex { found = 1 } END { exit !found }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

pick_ports() {  # fill CTLD_PORT / SLURMD_PORT that were not given: 6817/6818 if free, else the next free ones
    local port=6817
    if [[ -z "$CTLD_PORT" ]]; then
        while port_in_use "$port" || [[ "$port" == "$SLURMD_PORT" ]]; do port=$((port + 1)); done
        CTLD_PORT=$port
    fi
    port=$((CTLD_PORT + 1))
    if [[ -z "$SLURMD_PORT" ]]; then
        while port_in_use "$port" || [[ "$port" == "$CTLD_PORT" ]]; do port=$((port + 1)); done
        SLURMD_PORT=$port
    fi
    [[ "$CTLD_PORT" -le 65535 && "$SLURMD_PORT" -le 65535 ]] || die "no free ports for slurmctld and slurmd"
    local given
    for given in "$CTLD_PORT" "$SLURMD_PORT"; do
        ! port_in_use "$given" || die "port $given is in use (another SLURM?); choose another with --ctld-port/--slurmd-port"
    done
}

conf_value() {  # KEY: its value in this instance's slurm.conf
    awk -F= -v key="$1" '$1 == key { print $2 }' "$CONF"
}

node_cpus() {
    awk '$1 ~ /^NodeName=/ { for (i = 2; i <= NF; i++) if ($i ~ /^CPUs=/) print substr($i, 6) }' "$CONF"
}

conf_common() {  # SPOOL_SUFFIX NAME_SUFFIX MPI_DEFAULT: the slurm.conf lines both kinds of cluster share
    # (emulated nodes give slurmd a spool folder, pid and log file each: /%n and -%n)
    cat <<EOF
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation="$SLURM_DIR/state"
SlurmdSpoolDir="$SLURM_DIR/spool$1"
SlurmctldPidFile="$SLURM_DIR/slurmctld.pid"
SlurmdPidFile="$SLURM_DIR/slurmd$2.pid"
SlurmctldLogFile="$SLURM_DIR/log/slurmctld.log"
SlurmdLogFile="$SLURM_DIR/log/slurmd$2.log"
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=$3
ReturnToService=2
SlurmdParameters=config_overrides
MaxArraySize=10001
MinJobAge=30
KillWait=10
InactiveLimit=0
EOF
}

write_conf() {
    local cpus memory_mb
    # the CPUs this process may run on (nproc alone also obeys OMP_NUM_THREADS, which scripts set to 1)
    cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
    memory_mb="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
    pick_ports
    mkdir -p "$SLURM_DIR/state" "$SLURM_DIR/spool" "$SLURM_DIR/log"
    cat >"$CONF" <<EOF
# Written by relaympi jobs/local_cluster.sh: a one-node cluster on localhost.
ClusterName=relaympi
SlurmctldHost=localhost
$(conf_common "" "" none)
NodeName=localhost CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        return
    fi
    if [[ ! -s "$MUNGE_KEY" ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of="$MUNGE_KEY" status=none
        chown munge:munge "$MUNGE_KEY"
        chmod 400 "$MUNGE_KEY"
    fi
    mkdir -p "$MUNGE_RUN" /var/log/munge /var/lib/munge
    chown munge:munge "$MUNGE_RUN" /var/log/munge /var/lib/munge
    runuser -u munge -- munged
    for _ in $(seq 50); do
        if munge_ok; then
            cat "$MUNGE_RUN/munged.pid" >"$MUNGED_OURS"
            return
        fi
        sleep 0.1
    done
    die "munged did not come up"
}

daemon_running() {  # pidfile
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

instance_running() {
    daemon_running "$SLURM_DIR/slurmctld.pid" || daemon_running "$SLURM_DIR/slurmd.pid"
}

start() {
    need_root start
    command -v slurmctld >/dev/null || die "SLURM is not installed: run '$0 install' first"
    if instance_running && [[ -f "$CONF" ]]; then  # keep the ports its daemons listen on
        CTLD_PORT="$(conf_value SlurmctldPort)" SLURMD_PORT="$(conf_value SlurmdPort)"
        PARTITION="$(awk -F'[= ]' '$1 == "PartitionName" { print $2 }' "$CONF")"
    else
        write_conf
    fi
    start_munge
    export SLURM_CONF="$CONF"
    daemon_running "$SLURM_DIR/slurmctld.pid" || slurmctld
    daemon_running "$SLURM_DIR/slurmd.pid" || slurmd
    local state=""
    for _ in $(seq 120); do
        state="$(sinfo -h -n localhost -o %T 2>/dev/null || true)"
        [[ "$state" == idle || "$state" == mixed || "$state" == allocated ]] && break
        sleep 0.5
    done
    if [[ "$state" == down* || "$state" == drain* ]]; then
        scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
        sleep 1
        state="$(sinfo -h -n localhost -o %T 2>/dev/null || true)"
    fi
    [[ "$state" == idle || "$state" == mixed || "$state" == allocated ]] \
        || die "node not idle after 60 s (state '$state'); logs in $SLURM_DIR/log"
    echo "SLURM is up: partition $PARTITION, node localhost ($(node_cpus) CPUs), ports $CTLD_PORT/$SLURMD_PORT, in $SLURM_DIR" >&2
    printf 'export SLURM_CONF=%q\n' "$CONF"  # for eval: a folder may hold spaces
}

stop() {
    need_root stop
    if [[ -f "$CONF" ]]; then
        SLURM_CONF="$CONF" scontrol shutdown >/dev/null 2>&1 || true
        for _ in $(seq 50); do
            instance_running || break
            sleep 0.2
        done
        local daemon
        for daemon in slurmctld slurmd; do  # a daemon that missed the shutdown: by this instance's pid file only
            if daemon_running "$SLURM_DIR/$daemon.pid"; then
                kill "$(cat "$SLURM_DIR/$daemon.pid")" 2>/dev/null || true
            fi
        done
        for _ in $(seq 50); do
            instance_running || break
            sleep 0.2
        done
        ! instance_running || die "the daemons of $SLURM_DIR are still running"
    fi
    stop_munge
    echo "SLURM stopped ($SLURM_DIR)" >&2
}

stop_munge() {  # the munged a start started, once no SLURM daemon on this machine needs it
    [[ -s "$MUNGED_OURS" ]] || return 0
    # another instance (or another SLURM) still runs: the last stop ends munged (zombies of
    # daemons that just exited do not count)
    if ps -eo stat=,comm= | awk '$1 !~ /^Z/ && ($2 == "slurmctld" || $2 == "slurmd") { found = 1 } END { exit !found }'; then
        return 0
    fi
    if [[ -s "$MUNGE_RUN/munged.pid" && "$(cat "$MUNGE_RUN/munged.pid")" == "$(cat "$MUNGED_OURS")" ]]; then
        kill "$(cat "$MUNGED_OURS")" 2>/dev/null || true
    fi
    rm -f "$MUNGED_OURS"
}

status() {
    if [[ ! -f "$CONF" ]]; then
        echo "no local cluster configured under $SLURM_DIR"
        return 1
    fi
    echo "SLURM_CONF=$CONF (ports $(conf_value SlurmctldPort)/$(conf_value SlurmdPort))"
    daemon_running "$SLURM_DIR/slurmctld.pid" && echo "slurmctld: running" || echo "slurmctld: stopped"
    daemon_running "$SLURM_DIR/slurmd.pid" && echo "slurmd: running" || echo "slurmd: stopped"
    munge_ok && echo "munged: running" || echo "munged: stopped"
    SLURM_CONF="$CONF" sinfo 2>/dev/null || return 1
}


# ---------------------------------------------------------------------------------------------
# Emulated nodes: one network namespace + one hostname each, veth to a bridge, tc tbf per link.

need_nodes() {  # root and namespaces, or exit 2 with one line
    [[ "$(id -u)" == 0 ]] || { echo "local_cluster.sh: --nodes needs root (network namespaces, tc): try sudo bash $0 $1" >&2; exit 2; }
    local tool
    for tool in ip tc unshare nsenter; do
        command -v "$tool" >/dev/null || { echo "local_cluster.sh: --nodes needs '$tool' (iproute2, util-linux)" >&2; exit 2; }
    done
    unshare --net --uts true 2>/dev/null || { echo "local_cluster.sh: --nodes needs network and UTS namespaces, which this machine refuses (a container without CAP_SYS_ADMIN?)" >&2; exit 2; }
}

load_nodes() {  # this folder's emulated-nodes record (written before anything is made)
    [[ -s "$NODES_ENV" ]] || return 1
    # shellcheck disable=SC1090  # KEY=VALUE lines this script wrote
    source "$NODES_ENV"
}

save_nodes() {
    mkdir -p "$SLURM_DIR"
    printf 'N_NODES=%s\nN_SUBNET=%s\nN_TAG=%s\nN_IFACE=%s\nN_LINK=%s\nN_CPUS=%s\n' \
        "$N_NODES" "$N_SUBNET" "$N_TAG" "$N_IFACE" "$N_LINK" "$N_CPUS" >"$NODES_ENV"
}

node_ns() { echo "rmpi$N_TAG-node$1"; }    # namespace of node I
node_veth() { echo "rmpi${N_TAG}n$1"; }    # its link's end in the root namespace
node_addr() { echo "$N_SUBNET.$((10 + $1))"; }

subnet_free() {  # A.B.C: no address or route of this machine reaches into A.B.C.0/24
    [[ -z "$(ip -4 route show match "$1.0/24" | grep -v '^default')" ]] \
        && [[ -z "$(ip -4 route show root "$1.0/24")" ]]
}

pick_subnet() {
    if [[ -n "$SUBNET" ]]; then
        subnet_free "$SUBNET" || die "--subnet $SUBNET: this machine already has addresses or routes in $SUBNET.0/24; choose another"
        N_SUBNET="$SUBNET"
        return
    fi
    local c
    for c in $(seq 7 254); do
        if subnet_free "10.213.$c"; then N_SUBNET="10.213.$c"; return; fi
    done
    die "no free subnet 10.213.7-254.0/24; give one with --subnet"
}

write_nodes_conf() {
    local memory_mb last="$N_NODES" i
    memory_mb="$(awk -v n="$N_NODES" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)"
    mkdir -p "$SLURM_DIR/state" "$SLURM_DIR/log"
    for i in $(seq "$N_NODES"); do mkdir -p "$SLURM_DIR/spool/node$i"; done
    cat >"$CONF" <<EOF
# Written by relaympi jobs/local_cluster.sh: $N_NODES emulated nodes on this machine ($N_SUBNET.0/24).
ClusterName=relaympi
SlurmctldHost=ctld($N_SUBNET.1)
# srun starts MPICH ranks itself through PMI2 (the jobs' default launcher); mpirun uses srun for its proxies
$(conf_common /%n -%n pmi2)
# a node that stops answering (killed, link down) is DOWN, and its jobs end, within ~30 s
SlurmdTimeout=20
MessageTimeout=5
NodeName=node[1-$last] NodeHostname=node[1-$last] NodeAddr=$N_SUBNET.[11-$((10 + last))] CPUs=$N_CPUS RealMemory=$memory_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=node[1-$last] Default=YES MaxTime=INFINITE State=UP
EOF
}

write_node_files() {  # the hosts file (mpiexec -f) and the rsh-style launcher (mpiexec -launcher-exec)
    local i
    : >"$SLURM_DIR/hosts"
    for i in $(seq "$N_NODES"); do echo "node$i" >>"$SLURM_DIR/hosts"; done
    {
        echo '#!/bin/sh'
        echo "# Written by relaympi jobs/local_cluster.sh: HOST COMMAND... runs COMMAND (joined, as rsh does) on"
        echo "# emulated node HOST (node1..node$N_NODES or its address): in its network namespace, with its hostname."
        echo "#   mpiexec -launcher rsh -launcher-exec $SLURM_DIR/launcher -f $SLURM_DIR/hosts -n N CMD"
        echo 'host="$1"; shift'
        echo 'case "$host" in'
        for i in $(seq "$N_NODES"); do
            echo "    node$i|$(node_addr "$i")) node=node$i ns=$(node_ns "$i") ;;"
        done
        echo '    *) echo "launcher: $host is not a node of this cluster (node1..node'"$N_NODES"')" >&2; exit 255 ;;'
        echo 'esac'
        echo '# Its own mount namespace shows the node'"'"'s own /sys/class/net (UCX finds its devices there);'
        echo '# the rest of /sys stays (not `ip netns exec`: it remounts all /sys, without the cgroup tree slurmd 22.05 needs).'
        # shellcheck disable=SC2016  # written for the launcher to expand
        echo 'exec nsenter --net="/run/netns/$ns" unshare --mount --uts sh -c '\''t="$(mktemp -d)" && mount -t sysfs sysfs "$t" && mount --bind "$t/class/net" /sys/class/net && mount --bind "$t/devices/virtual/net" /sys/devices/virtual/net && umount -l "$t" && rmdir "$t" && hostname "$0" && eval "$*"'\'' "$node" "$@"'
    } >"$SLURM_DIR/launcher"
    chmod 755 "$SLURM_DIR/launcher"
}

make_network() {  # idempotent: what is missing is made
    if ! ip link show "$N_IFACE" >/dev/null 2>&1; then
        ip link add "$N_IFACE" type bridge
        ip addr add "$N_SUBNET.1/24" dev "$N_IFACE"
    fi
    ip link set "$N_IFACE" up
    local i ns veth
    for i in $(seq "$N_NODES"); do
        ns="$(node_ns "$i")" veth="$(node_veth "$i")"
        [[ -e "/run/netns/$ns" ]] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name "$N_IFACE" netns "$ns"
            ip -n "$ns" addr add "$(node_addr "$i")/24" dev "$N_IFACE"
        fi
        ip link set "$veth" master "$N_IFACE" up
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$N_IFACE" up
    done
}

shape_links() {  # every node's link, both directions: tbf at RATE, or unshaped
    local bits burst i ns veth
    bits="$(link_rate_bits "$N_LINK")"
    burst=$((bits / 8 / 100))   # 10 ms at the rate, at least 64 KiB (a GSO segment)
    ((burst >= 65536)) || burst=65536
    for i in $(seq "$N_NODES"); do
        ns="$(node_ns "$i")" veth="$(node_veth "$i")"
        if ((bits == 0)); then
            tc qdisc del dev "$veth" root 2>/dev/null || true
            tc -n "$ns" qdisc del dev "$N_IFACE" root 2>/dev/null || true
        else
            tc qdisc replace dev "$veth" root tbf rate "$N_LINK" burst "$burst" latency 100ms             # into the node
            tc -n "$ns" qdisc replace dev "$N_IFACE" root tbf rate "$N_LINK" burst "$burst" latency 100ms  # out of it
        fi
    done
}

node_pid_file() { echo "$SLURM_DIR/slurmd-node$1.pid"; }

nodes_idle() {  # every node idle (or busy), none down
    local states
    states="$(sinfo -h -N -o %T 2>/dev/null | sed 's/[*~#!%$@^-]*$//')" || return 1
    [[ "$(grep -cE '^(idle|mixed|allocated|completing)$' <<<"$states")" == "$N_NODES" ]]
}

nodes_start() {
    need_nodes start
    command -v slurmctld >/dev/null || die "SLURM is not installed: run '$0 install' first"
    if load_nodes; then
        [[ -z "$NODES" || "$NODES" == "$N_NODES" ]] || die "$SLURM_DIR holds a cluster of $N_NODES nodes: stop it first, or give another --dir"
        [[ -z "$SUBNET" || "$SUBNET" == "$N_SUBNET" ]] || die "$SLURM_DIR's cluster uses $N_SUBNET: stop it first to change --subnet"
        [[ -z "$LINK" ]] || N_LINK="$LINK"
        CTLD_PORT="$(conf_value SlurmctldPort)" SLURMD_PORT="$(conf_value SlurmdPort)"
        PARTITION="$(awk -F'[= ]' '$1 == "PartitionName" { print $2 }' "$CONF")"
    else
        if instance_running; then
            die "$SLURM_DIR holds a running one-node cluster: give --nodes its own --dir"
        fi
        N_NODES="$NODES" N_LINK="${LINK:-none}"
        N_CPUS="${CPUS_PER_NODE:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
        pick_ports
        pick_subnet
        N_TAG="$CTLD_PORT" N_IFACE="rmpi$CTLD_PORT"
        ! ip link show "$N_IFACE" >/dev/null 2>&1 || die "a link named $N_IFACE exists already (another instance's? stop that one with its --dir)"
        save_nodes  # first: a stop after a crash finds what to remove
        write_nodes_conf
    fi
    save_nodes
    write_node_files
    make_network
    shape_links
    start_munge
    export SLURM_CONF="$CONF"
    # slurmctld answers to the name SlurmctldHost gives: its own hostname, in its own UTS namespace
    daemon_running "$SLURM_DIR/slurmctld.pid" || unshare --uts sh -c 'hostname ctld && exec slurmctld -f "$0"' "$CONF"
    local i
    for i in $(seq "$N_NODES"); do
        # in the node's namespaces, with its hostname (the launcher: as mpiexec's processes)
        daemon_running "$(node_pid_file "$i")" || "$SLURM_DIR/launcher" "node$i" "exec slurmd -f $(printf %q "$CONF")"
    done
    for _ in $(seq 120); do
        nodes_idle && break
        if sinfo -h -N -o %T 2>/dev/null | grep -qE '^(down|drain)'; then
            scontrol update nodename="node[1-$N_NODES]" state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    nodes_idle || die "nodes not all idle after 60 s ($(sinfo -h -N -o '%N:%T' 2>/dev/null | tr '\n' ' ')); logs in $SLURM_DIR/log"
    echo "SLURM is up: $N_NODES nodes node[1-$N_NODES] ($N_CPUS CPUs each) on $N_SUBNET.0/24, links $N_LINK, ports $CTLD_PORT/$SLURMD_PORT, in $SLURM_DIR" >&2
    # RELAYMPI_SLURM_DIR: status, link and stop in this shell act on this cluster
    printf 'export SLURM_CONF=%q RELAYMPI_SLURM_DIR=%q\n' "$CONF" "$SLURM_DIR"
    # MPICH (ch4:ucx): TCP over the nodes' links, not UCX's shared memory across the namespaces;
    # hydra's control connections by address (the nodes' names resolve nowhere)
    printf 'export UCX_TLS=tcp UCX_NET_DEVICES=%s HYDRA_IFACE=%s\n' "$N_IFACE" "$N_IFACE"
    printf 'export RELAYMPI_CLUSTER_HOSTS=%q RELAYMPI_CLUSTER_LAUNCHER=%q\n' "$SLURM_DIR/hosts" "$SLURM_DIR/launcher"
    # the sweeps (jobs/): mpirun (hydra, which starts its proxies with srun) rather than srun alone:
    # srun --mpi=pmi2 starts small MPICH programs, but the trainer's start-up breaks its PMI2 exchange
    printf 'export RELAYMPI_LAUNCHER=mpirun\n'
    # run files record it (provenance.emulated_link): the report keeps emulated figures apart
    printf 'export RELAYMPI_EMULATED_LINK=%q\n' "$N_LINK"
}

nodes_link() {
    need_nodes link
    load_nodes || die "no emulated nodes under $SLURM_DIR (start --nodes N first)"
    N_LINK="$LINK"
    save_nodes
    shape_links
    echo "links of $SLURM_DIR's $N_NODES nodes: $N_LINK" >&2
    printf 'export RELAYMPI_EMULATED_LINK=%q\n' "$N_LINK"  # eval it: later runs record the new rate
}

kill_pids() {  # PIDS...: TERM, then KILL what is left after 5 s
    (($#)) || return 0
    kill "$@" 2>/dev/null || true
    for _ in $(seq 25); do
        kill -0 "$@" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -9 "$@" 2>/dev/null || true
}

our_namespaces() { ip netns list | awk -v p="rmpi$N_TAG-node" 'index($1, p) == 1 { print $1 }'; }

nodes_stop() {
    need_nodes stop
    load_nodes || return 0
    if [[ -f "$CONF" ]]; then
        SLURM_CONF="$CONF" timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    fi
    local ns pids=()
    # every process in this cluster's node namespaces (slurmd, jobs, launched ranks), and its slurmctld
    for ns in $(our_namespaces); do
        # shellcheck disable=SC2207  # pids: numbers
        pids+=($(ip netns pids "$ns" 2>/dev/null))
    done
    local ctld
    ctld="$(cat "$SLURM_DIR/slurmctld.pid" 2>/dev/null || true)"
    [[ "$ctld" =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$ctld/comm" 2>/dev/null)" == slurmctld ]] && pids+=("$ctld")
    kill_pids "${pids[@]}"
    for ns in $(our_namespaces); do
        ip netns del "$ns"  # and with it the node's veth pair
    done
    local link
    for link in $(ip -o link show | awk -F': ' -v p="rmpi${N_TAG}n" '{ sub(/@.*/, "", $2) } index($2, p) == 1 { print $2 }'); do
        ip link del "$link" 2>/dev/null || true
    done
    ip link del "$N_IFACE" 2>/dev/null || true
    rm -rf "$SLURM_DIR/state" "$SLURM_DIR/spool" "$SLURM_DIR/log"
    rm -f "$CONF" "$SLURM_DIR/hosts" "$SLURM_DIR/launcher" "$SLURM_DIR/slurmctld.pid" "$SLURM_DIR"/slurmd-node*.pid "$NODES_ENV"
    rmdir "$SLURM_DIR" 2>/dev/null || true
}

nodes_status() {
    echo "SLURM_CONF=$CONF (ports $(conf_value SlurmctldPort)/$(conf_value SlurmdPort))"
    echo "nodes: $N_NODES on $N_SUBNET.0/24 (bridge $N_IFACE), links $N_LINK, $N_CPUS CPUs each"
    daemon_running "$SLURM_DIR/slurmctld.pid" && echo "slurmctld: running" || echo "slurmctld: stopped"
    local i ns up
    for i in $(seq "$N_NODES"); do
        ns="$(node_ns "$i")"
        if [[ -e "/run/netns/$ns" ]]; then
            up="$(ip -n "$ns" -br link show "$N_IFACE" 2>/dev/null | awk '{ print $2 }')"
            echo "node$i: $(node_addr "$i"), namespace $ns, link ${up:-missing}, slurmd $(daemon_running "$(node_pid_file "$i")" && echo running || echo stopped)"
        else
            echo "node$i: namespace $ns missing"
        fi
    done
    munge_ok && echo "munged: running" || echo "munged: stopped"
    SLURM_CONF="$CONF" sinfo -N 2>/dev/null || return 1
}

command="${1:-}"
if (($#)); then shift; fi
if [[ "$command" == link ]]; then
    [[ $# -ge 1 && "$1" != --* ]] || usage "link needs a RATE (e.g. 1gbit, 100mbit, none)"
    set -- --link "$@"
fi
parse_options "$@"
case "$command" in
    install) install ;;
    start) if [[ -n "$NODES" ]] || load_nodes; then nodes_start; else start; fi ;;
    stop) if [[ -s "$NODES_ENV" ]]; then nodes_stop; stop_munge; echo "SLURM stopped, nodes removed ($SLURM_DIR)" >&2; else stop; fi ;;
    status) if load_nodes; then nodes_status; else status; fi ;;
    link) nodes_link ;;
    *) usage "unknown command '$command'" ;;
esac

# Emulated nodes: a cluster of N hosts on this machine (`start --nodes N`): one network namespace
# and one hostname (UTS namespace) each, a veth pair to a bridge, tc tbf per link, a slurmd each.
# Sourced by cluster/local_cluster.sh after cluster/slurm.sh, whose ports, slurm.conf lines,
# munged and pid-file helpers it uses; not run on its own.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "nodes.sh: sourced by cluster/local_cluster.sh; run that (--help)" >&2
    exit 2
fi

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

need_nodes() {  # root and namespaces, or exit 2 with one line
    [[ "$(id -u)" == 0 ]] || { echo "local_cluster.sh: --nodes needs root (network namespaces, tc): try sudo bash $0 $1" >&2; exit 2; }
    local tool
    for tool in ip tc unshare nsenter; do
        command -v "$tool" >/dev/null || { echo "local_cluster.sh: --nodes needs '$tool' (iproute2, util-linux)" >&2; exit 2; }
    done
    unshare --net --uts true 2>/dev/null || { echo "local_cluster.sh: --nodes needs network and UTS namespaces, which this machine refuses (a container without CAP_SYS_ADMIN?)" >&2; exit 2; }
}

NODES_KEYS=(N_NODES N_SUBNET N_TAG N_IFACE N_LINK N_CPUS)

nodes_value_ok() {  # KEY VALUE: a value this script could have written for KEY
    case "$1" in
        N_NODES) [[ "$2" =~ ^[1-9][0-9]?$ && "$2" -le 64 ]] ;;
        N_SUBNET) valid_subnet "$2" ;;
        N_TAG) [[ "$2" =~ ^[1-9][0-9]{3,4}$ ]] ;;
        N_IFACE) [[ "$2" =~ ^rmpi[1-9][0-9]{3,4}$ ]] ;;
        N_LINK) link_rate_bits "$2" >/dev/null ;;
        N_CPUS) [[ "$2" =~ ^[1-9][0-9]{0,5}$ ]] ;;
        *) return 1 ;;
    esac
}

load_nodes() {  # this folder's emulated-nodes record (written before anything is made)
    [[ -s "$NODES_ENV" ]] || return 1
    # read, never sourced: each line one known KEY with a value of its syntax, or a refusal
    local line key value shown
    for key in "${NODES_KEYS[@]}"; do printf -v "$key" '%s' ""; done
    while IFS= read -r line || [[ -n "$line" ]]; do
        key="${line%%=*}" value="${line#*=}"
        if [[ "$line" != *=* ]] || ! nodes_value_ok "$key" "$value"; then
            printf -v shown '%q' "$line"
            refuse "$NODES_ENV: line $shown is not one this script writes (${NODES_KEYS[*]}); remove the folder's cluster by hand"
        fi
        printf -v "$key" '%s' "$value"
    done <"$NODES_ENV"
    for key in "${NODES_KEYS[@]}"; do
        [[ -n "${!key}" ]] || refuse "$NODES_ENV lacks $key; remove the folder's cluster by hand"
    done
}

save_nodes() {
    printf 'N_NODES=%s\nN_SUBNET=%s\nN_TAG=%s\nN_IFACE=%s\nN_LINK=%s\nN_CPUS=%s\n' \
        "$N_NODES" "$N_SUBNET" "$N_TAG" "$N_IFACE" "$N_LINK" "$N_CPUS" | write_state nodes.env 644
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
    write_state slurm.conf 644 <<EOF
# Written by relaympi cluster/local_cluster.sh: $N_NODES emulated nodes on this machine ($N_SUBNET.0/24).
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
    for i in $(seq "$N_NODES"); do echo "node$i"; done | write_state hosts 644
    {
        echo '#!/bin/sh'
        echo "# Written by relaympi cluster/local_cluster.sh: HOST COMMAND... runs COMMAND (joined, as rsh does) on"
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
    } | write_state launcher 755
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
    daemon_running "$SLURM_DIR/slurmctld.pid" slurmctld || unshare --uts sh -c 'hostname ctld && exec slurmctld -f "$0"' "$CONF"
    local i
    for i in $(seq "$N_NODES"); do
        # in the node's namespaces, with its hostname (the launcher: as mpiexec's processes)
        daemon_running "$(node_pid_file "$i")" slurmd || "$SLURM_DIR/launcher" "node$i" "exec slurmd -f $(printf %q "$CONF")"
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
    if ctld="$(pid_of "$SLURM_DIR/slurmctld.pid" slurmctld "$CONF")"; then pids+=("$ctld"); fi
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
    daemon_running "$SLURM_DIR/slurmctld.pid" slurmctld && echo "slurmctld: running" || echo "slurmctld: stopped"
    local i ns up
    for i in $(seq "$N_NODES"); do
        ns="$(node_ns "$i")"
        if [[ -e "/run/netns/$ns" ]]; then
            up="$(ip -n "$ns" -br link show "$N_IFACE" 2>/dev/null | awk '{ print $2 }')"
            echo "node$i: $(node_addr "$i"), namespace $ns, link ${up:-missing}, slurmd $(daemon_running "$(node_pid_file "$i")" slurmd && echo running || echo stopped)"
        else
            echo "node$i: namespace $ns missing"
        fi
    done
    munge_ok && echo "munged: running" || echo "munged: stopped"
    SLURM_CONF="$CONF" sinfo -N 2>/dev/null || return 1
}


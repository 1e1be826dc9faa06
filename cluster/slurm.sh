# One-node SLURM on localhost (install, start, stop, status), and what the emulated nodes
# (cluster/nodes.sh) share with it: ports, the slurm.conf lines common to both, munged, pid files.
# Sourced by cluster/local_cluster.sh, which parses the options into SLURM_DIR, CONF, CTLD_PORT,
# SLURMD_PORT and PARTITION and defines die and usage; not run on its own.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "slurm.sh: sourced by cluster/local_cluster.sh; run that (--help)" >&2
    exit 2
fi

MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN=/run/munge
MUNGED_OURS=/run/relaympi-local-cluster.munged  # pid of the munged that a start started

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
# Written by relaympi cluster/local_cluster.sh: a one-node cluster on localhost.
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


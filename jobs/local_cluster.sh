#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying sweeps on a laptop or in CI.
#
#   sudo bash jobs/local_cluster.sh install   # Debian/Ubuntu: slurmctld slurmd slurm-client munge
#   sudo bash jobs/local_cluster.sh start     # then: export SLURM_CONF=... (printed)
#   bash jobs/local_cluster.sh status
#   sudo bash jobs/local_cluster.sh stop
#
# State, logs and slurm.conf live under ${RELAYMPI_SLURM_DIR:-/tmp/relaympi-slurm}; the
# system's own /etc/slurm is never touched. Needs root (munged runs as user munge).
set -euo pipefail

SLURM_DIR="${RELAYMPI_SLURM_DIR:-/tmp/relaympi-slurm}"
CONF="$SLURM_DIR/slurm.conf"
PARTITION="${RELAYMPI_SLURM_PARTITION:-debug}"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN=/run/munge

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

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

write_conf() {
    local cpus memory_mb
    cpus="$(nproc)"
    memory_mb="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
    mkdir -p "$SLURM_DIR/state" "$SLURM_DIR/spool" "$SLURM_DIR/log"
    cat >"$CONF" <<EOF
# Written by relaympi jobs/local_cluster.sh: a one-node cluster on localhost.
ClusterName=relaympi
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MaxArraySize=10001
MinJobAge=30
KillWait=10
InactiveLimit=0
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
    touch "$SLURM_DIR/munged.started-by-us"
    for _ in $(seq 50); do munge_ok && return; sleep 0.1; done
    die "munged did not come up"
}

daemon_running() {  # pidfile
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
    need_root start
    command -v slurmctld >/dev/null || die "SLURM is not installed: run '$0 install' first"
    write_conf
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
    echo "SLURM is up: partition $PARTITION, node localhost ($(nproc) CPUs)" >&2
    echo "export SLURM_CONF=$CONF"
}

stop() {
    need_root stop
    if [[ -f "$CONF" ]]; then
        SLURM_CONF="$CONF" scontrol shutdown >/dev/null 2>&1 || true
        for _ in $(seq 50); do
            daemon_running "$SLURM_DIR/slurmctld.pid" || daemon_running "$SLURM_DIR/slurmd.pid" || break
            sleep 0.2
        done
    fi
    if [[ -f "$SLURM_DIR/munged.started-by-us" && -s "$MUNGE_RUN/munged.pid" ]]; then
        kill "$(cat "$MUNGE_RUN/munged.pid")" 2>/dev/null || true
        rm -f "$SLURM_DIR/munged.started-by-us"
    fi
    echo "SLURM stopped" >&2
}

status() {
    if [[ ! -f "$CONF" ]]; then
        echo "no local cluster configured under $SLURM_DIR"
        return 1
    fi
    echo "SLURM_CONF=$CONF"
    daemon_running "$SLURM_DIR/slurmctld.pid" && echo "slurmctld: running" || echo "slurmctld: stopped"
    daemon_running "$SLURM_DIR/slurmd.pid" && echo "slurmd: running" || echo "slurmd: stopped"
    munge_ok && echo "munged: running" || echo "munged: stopped"
    SLURM_CONF="$CONF" sinfo 2>/dev/null || return 1
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac

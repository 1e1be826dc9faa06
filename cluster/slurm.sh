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

refuse() { echo "local_cluster.sh: $*" >&2; exit 2; }

# The state folder. Root reads, runs and writes what it holds, so it must be root's own (or, for
# a user's status, that user's) and closed to others' writes, and so must every folder above it
# (a sticky one such as /tmp: there only an entry's owner may rename it). A folder someone else
# made first, or could swap, is refused: its nodes.env, slurm.conf, pid files and launcher would
# be theirs.
STATE_FILES=(slurm.conf nodes.env hosts launcher)

trusted_owner() { [[ "$1" == 0 || "$1" == "$(id -u)" ]]; }

check_folder_chain() {  # FOLDER (canonical, existing): it and every folder above it, or refuse
    local folder="$1" dir uid mode
    read -r uid mode < <(stat -c '%u %a' -- "$folder")
    trusted_owner "$uid" || refuse "state folder $folder is owned by uid $uid, not root: refusing a folder another user made; give --dir a new folder or one of root's"
    ((!(8#$mode & 8#022))) || refuse "state folder $folder is writable by group or others (mode $mode): refusing it; chmod go-w it or give another --dir"
    check_parents "$folder" "$(dirname -- "$folder")"
}

check_parents() {  # FOLDER DIR (canonical, existing): DIR and every folder above it may hold FOLDER safely, or refuse
    local folder="$1" dir="$2" uid mode
    while :; do
        read -r uid mode < <(stat -c '%u %a' -- "$dir")
        trusted_owner "$uid" || refuse "state folder $folder lies in $dir, owned by uid $uid, who could replace it: give --dir a folder in one of root's"
        ((!(8#$mode & 8#022) || (8#$mode & 8#1000))) || refuse "state folder $folder lies in $dir, writable by group or others without the sticky bit (mode $mode): give --dir a folder in one of root's"
        [[ "$dir" != / ]] || break
        dir="$(dirname -- "$dir")"
    done
}

open_state_dir() {  # create|existing: check SLURM_DIR (made 0700 first with create) and take its canonical path
    local dir="$SLURM_DIR" up
    [[ ! -L "$dir" ]] || refuse "state folder $dir is a symbolic link: give --dir the folder itself"
    if [[ ! -e "$dir" ]]; then
        [[ "$1" == create ]] || return 0  # nothing there: nothing to read, stop or show
        up="$dir"
        while [[ ! -e "$up" ]]; do up="$(dirname -- "$up")"; done
        [[ -d "$up" ]] || refuse "state folder $dir: $up is not a folder"
        # before anything is made in it: the nearest folder that exists will hold the new one (a
        # sticky /tmp is fine there); the new folder itself is checked once made
        check_parents "$dir" "$(realpath -e -- "$up")"
        (umask 077 && mkdir -p -- "$dir")
    fi
    [[ -d "$dir" ]] || refuse "state folder $dir is not a folder"
    dir="$(realpath -e -- "$dir")"
    check_folder_chain "$dir"
    [[ -r "$dir" && -x "$dir" ]] || refuse "state folder $dir is root's alone (mode $(stat -c %a -- "$dir")): run this as root"
    local name
    for name in "${STATE_FILES[@]}" slurmctld.pid slurmd.pid; do
        [[ ! -L "$dir/$name" ]] || refuse "state folder $dir holds $name as a symbolic link: refusing to read or write through it; remove it"
    done
    for name in "$dir"/slurmd-node*.pid; do
        [[ ! -L "$name" ]] || refuse "state folder $dir holds ${name##*/} as a symbolic link: refusing to read or write through it; remove it"
    done
    SLURM_DIR="$dir" CONF="$dir/slurm.conf" NODES_ENV="$dir/nodes.env"
}

write_state() {  # NAME MODE < CONTENT: SLURM_DIR/NAME replaced whole, through a new temp file (never through a link)
    local tmp
    tmp="$(mktemp -- "$SLURM_DIR/.$1.XXXXXXXX")"
    cat >"$tmp"
    chmod "$2" -- "$tmp"
    mv -fT -- "$tmp" "$SLURM_DIR/$1"
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
    write_state slurm.conf 644 <<EOF
# Written by relaympi cluster/local_cluster.sh: a one-node cluster on localhost.
ClusterName=relaympi
SlurmctldHost=localhost
$(conf_common "" "" none)
NodeName=localhost CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

make_munge_key() {  # a new key, readable by no one else from its first byte: made 0600 under umask 077
    mkdir -p "$(dirname -- "$MUNGE_KEY")"
    rm -f -- "$MUNGE_KEY"  # an empty one
    (umask 077 && set -o noclobber && head -c 1024 /dev/urandom >"$MUNGE_KEY")
    chown munge:munge "$MUNGE_KEY"
    chmod 400 "$MUNGE_KEY"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        return
    fi
    [[ -s "$MUNGE_KEY" ]] || make_munge_key
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

pid_of() {  # PIDFILE NAME [CONF]: the pid it names, if that is a live NAME (given CONF: started with it)
    local pid=""
    [[ -f "$1" && ! -L "$1" ]] || return 1
    read -r pid <"$1" || [[ -n "$pid" ]] || return 1
    [[ "$pid" =~ ^[1-9][0-9]{0,9}$ ]] || return 1
    # a stale or planted pid names some other process: never signal or count that one
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || return 1
    [[ -z "${3:-}" ]] || grep -qxF -- "$3" < <(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    echo "$pid"
}

daemon_running() {  # PIDFILE NAME: a live NAME of this instance (its command line names our slurm.conf)
    pid_of "$1" "$2" "$CONF" >/dev/null
}

instance_running() {
    daemon_running "$SLURM_DIR/slurmctld.pid" slurmctld || daemon_running "$SLURM_DIR/slurmd.pid" slurmd
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
    # -f: the command line names the conf, by which stop and status know their daemons
    daemon_running "$SLURM_DIR/slurmctld.pid" slurmctld || slurmctld -f "$CONF"
    daemon_running "$SLURM_DIR/slurmd.pid" slurmd || slurmd -f "$CONF"
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
        local daemon pid
        for daemon in slurmctld slurmd; do  # a daemon that missed the shutdown: by this instance's pid file only
            if pid="$(pid_of "$SLURM_DIR/$daemon.pid" "$daemon" "$CONF")"; then
                kill "$pid" 2>/dev/null || true
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
    local pid
    if pid="$(pid_of "$MUNGE_RUN/munged.pid" munged)" && [[ "$pid" == "$(cat "$MUNGED_OURS")" ]]; then
        kill "$pid" 2>/dev/null || true
    fi
    rm -f "$MUNGED_OURS"
}

status() {
    if [[ ! -f "$CONF" ]]; then
        echo "no local cluster configured under $SLURM_DIR"
        return 1
    fi
    echo "SLURM_CONF=$CONF (ports $(conf_value SlurmctldPort)/$(conf_value SlurmdPort))"
    daemon_running "$SLURM_DIR/slurmctld.pid" slurmctld && echo "slurmctld: running" || echo "slurmctld: stopped"
    daemon_running "$SLURM_DIR/slurmd.pid" slurmd && echo "slurmd: running" || echo "slurmd: stopped"
    munge_ok && echo "munged: running" || echo "munged: stopped"
    SLURM_CONF="$CONF" sinfo 2>/dev/null || return 1
}


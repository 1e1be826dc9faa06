# shellcheck shell=bash
# Sourced by the sweep scripts and submit.sh: site settings, environment set-up, and the hand-off
# to jobs/grid.py (the grid itself is jobs/sweeps.py). Settings: environment first, then $RELAYMPI_JOBS_CONFIG.

RELAYMPI_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RELAYMPI_ROOT

# relaympi_cfg NAME [DEFAULT]: the setting NAME from the environment, else from the KEY=VALUE
# file $RELAYMPI_JOBS_CONFIG, else DEFAULT: jobs/settings.py reads it (the parser grid.py uses).
# Before relaympi_setup has chosen the Python, any python3 does (the parser is standard library).
relaympi_cfg() {
    "${RELAYMPI_PY:-python3}" "$RELAYMPI_ROOT/jobs/settings.py" "$@"
}

# relaympi_config_trusted: the settings file is one only its owner (you, or root) may write, or
# it is refused in one line: its RELAYMPI_PRELUDE is eval'd and its RELAYMPI_PYTHON run, as you.
relaympi_config_trusted() {
    local config="${RELAYMPI_JOBS_CONFIG:-}" owner mode
    [[ -n "$config" && -e "$config" ]] || return 0  # none, or settings.py says it cannot read it
    read -r owner mode < <(stat -L -c '%u %a' -- "$config") || return 0
    if [[ "$owner" != 0 && "$owner" != "$(id -u)" ]]; then
        echo "RELAYMPI_JOBS_CONFIG=$config belongs to uid $owner: its prelude and Python would run as you; use a file of your own" >&2
        return 1
    fi
    if ((8#$mode & 8#022)); then
        echo "RELAYMPI_JOBS_CONFIG=$config is writable by group or others (mode $mode): its prelude and Python would run as you; chmod go-w it" >&2
        return 1
    fi
}

# relaympi_setup: load modules, run the site prelude, choose the Python; sets RELAYMPI_PY.
relaympi_setup() {
    local modules prelude
    relaympi_config_trusted || return 1
    modules="$(relaympi_cfg RELAYMPI_MODULES)"
    prelude="$(relaympi_cfg RELAYMPI_PRELUDE)"
    if [[ -n "$modules" ]]; then
        command -v module >/dev/null 2>&1 || { echo "RELAYMPI_MODULES is set but 'module' is not available" >&2; return 1; }
        # shellcheck disable=SC2086  # a list of module names
        module load $modules
    fi
    if [[ -n "$prelude" ]]; then
        eval "$prelude"
    fi
    RELAYMPI_PY="$(relaympi_cfg RELAYMPI_PYTHON)"
    if [[ -z "$RELAYMPI_PY" ]]; then
        if [[ -x "$RELAYMPI_ROOT/.venv/bin/python" ]]; then
            RELAYMPI_PY="$RELAYMPI_ROOT/.venv/bin/python"
        else
            RELAYMPI_PY="$(command -v python3 || command -v python)"
        fi
    fi
    export RELAYMPI_PYTHON="$RELAYMPI_PY"
    export PYTHONPATH="$RELAYMPI_ROOT${PYTHONPATH:+:$PYTHONPATH}"
}

# relaympi_sweep SWEEP [--dry-run | --index I]: run this array task's configuration (or list them).
# exec: SLURM's time-limit signal (B:USR1) goes to this process, and grid.py forwards it. By path,
# not `-m jobs.grid`: -m puts the working (submit) directory first on sys.path, where a folder
# named jobs/ would shadow the checkout's; PYTHONPATH (relaympi_setup) finds the rest.
relaympi_sweep() {
    relaympi_setup || exit 1
    exec "$RELAYMPI_PY" "$RELAYMPI_ROOT/jobs/grid.py" run "$@"
}

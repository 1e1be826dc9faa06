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

# relaympi_setup: load modules, run the site prelude, choose the Python; sets RELAYMPI_PY.
relaympi_setup() {
    local modules prelude
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

# shellcheck shell=bash
# Sourced by the sweep scripts and submit.sh: site settings, environment set-up, and the hand-off
# to jobs/grid.py (which owns the grid). Settings: environment first, then $RELAYMPI_JOBS_CONFIG.

RELAYMPI_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RELAYMPI_ROOT

# relaympi_cfg NAME [DEFAULT]: the setting NAME from the environment, else from the KEY=VALUE
# file $RELAYMPI_JOBS_CONFIG (same rules as jobs/grid.py's parser), else DEFAULT.
relaympi_cfg() {
    local name="$1" default="${2-}" file="${RELAYMPI_JOBS_CONFIG-}" line key value found="" result=""
    if [[ -n "${!name-}" ]]; then
        printf '%s' "${!name}"
        return
    fi
    if [[ -n "$file" && -r "$file" ]]; then
        while IFS= read -r line || [[ -n "$line" ]]; do
            line="${line#"${line%%[![:space:]]*}"}"
            line="${line%"${line##*[![:space:]]}"}"
            [[ -z "$line" || "$line" == \#* ]] && continue
            [[ "$line" == "export "* ]] && line="${line#export }" && line="${line#"${line%%[![:space:]]*}"}"
            key="${line%%=*}"
            value="${line#*=}"
            [[ "$key" == "$name" && "$line" == *=* ]] || continue
            if [[ ${#value} -ge 2 && ( "$value" == \"*\" || "$value" == \'*\' ) ]]; then
                value="${value:1:${#value}-2}"
            fi
            found=1
            result="$value"
        done <"$file"
    fi
    if [[ -n "$found" && -n "$result" ]]; then
        printf '%s' "$result"
    else
        printf '%s' "$default"
    fi
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
relaympi_sweep() {
    local sweep="$1"
    shift
    relaympi_setup || exit 1
    exec "$RELAYMPI_PY" "$RELAYMPI_ROOT/jobs/grid.py" run "$sweep" "$@"
}

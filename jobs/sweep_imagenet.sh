#!/bin/bash
#SBATCH --job-name=relaympi-imagenet
#SBATCH --array=0-4
#SBATCH --ntasks=16
#SBATCH --time=72:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# The paper's ImageNet table: alpha 0.1, 16 workers, one seed; needs RELAYMPI_DATA_DIR.
# Configurations: DRY_RUN=1 bash jobs/sweep_imagenet.sh. Submit: bash jobs/submit.sh sweep_imagenet (sizes the array
# from the grid and applies site settings), or plain sbatch jobs/sweep_imagenet.sh for the default grid.
# The grid lives in jobs/grid.py; every setting is a RELAYMPI_* variable (jobs/README.md).
# Under sbatch this file runs from a spool copy: find the checkout via RELAYMPI_ROOT, this
# file's directory, the submit directory, or else ask SLURM where the script was submitted from.
_relaympi_lib() {
    local dir
    for dir in "${RELAYMPI_ROOT-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR-}" \
        "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/..}"; do
        [[ -n "$dir" && -f "$dir/jobs/lib.sh" ]] && { echo "$dir/jobs/lib.sh"; return; }
    done
    [[ -n "${SLURM_JOB_ID-}" ]] || return 0
    dir="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/jobs/[^/]*$|\1|p' | head -n 1)"
    [[ -n "$dir" && -f "$dir/jobs/lib.sh" ]] && echo "$dir/jobs/lib.sh"
}
_lib="$(_relaympi_lib)"
[[ -n "$_lib" ]] || { echo "cannot find jobs/lib.sh: set RELAYMPI_ROOT to the relaympi checkout" >&2; exit 2; }
# shellcheck source=lib.sh
source "$_lib"
relaympi_sweep sweep_imagenet "$@"

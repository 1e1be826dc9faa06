#!/bin/bash
#SBATCH --job-name=relaympi-workers
#SBATCH --array=0-35
#SBATCH --ntasks=64
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# The paper's scaling table: 16, 32 and 64 workers at alpha 0.01 (submit.sh asks for each world size's own --ntasks).
# Configurations: DRY_RUN=1 bash jobs/sweep_workers.sh. Submit: bash jobs/submit.sh sweep_workers (sizes the array
# from the grid and applies site settings), or plain sbatch jobs/sweep_workers.sh for the default grid.
# The grid lives in jobs/sweeps.py; every setting is a RELAYMPI_* variable (jobs/README.md).
# Under sbatch this file runs from a spool copy: find the checkout (RELAYMPI_ROOT, this file's
# folder, the submit folder, or where SLURM says the script came from) and hand over to jobs/lib.sh.
for root in "${RELAYMPI_ROOT-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR-}" "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/..}" ask; do
    [[ "$root" == ask && -n "${SLURM_JOB_ID-}" ]] && root="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/jobs/[^/]*$|\1|p' | head -n 1)"  # an array's last task lists them all
    [[ -n "$root" && -f "$root/jobs/lib.sh" ]] && source "$root/jobs/lib.sh" && relaympi_sweep sweep_workers "$@"
done
echo "cannot find jobs/lib.sh: set RELAYMPI_ROOT to the relaympi checkout" >&2; exit 2

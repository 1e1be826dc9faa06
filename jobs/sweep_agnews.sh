#!/bin/bash
#SBATCH --job-name=relaympi-agnews
#SBATCH --array=0-14
#SBATCH --ntasks=16
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# The paper's AG News / DistilBERT table with Adam at alpha 0.1; needs RELAYMPI_DATA_DIR and RELAYMPI_MODEL_DIR.
# Configurations: DRY_RUN=1 bash jobs/sweep_agnews.sh. Submit: bash jobs/submit.sh sweep_agnews (sizes the array
# from the grid and applies site settings), or plain sbatch jobs/sweep_agnews.sh for the default grid.
# The grid lives in jobs/sweeps.py; every setting is a RELAYMPI_* variable (jobs/README.md).
# Under sbatch this file runs from a spool copy: find the checkout (RELAYMPI_ROOT, this file's
# folder, the submit folder, or where SLURM says the script came from) and hand over to jobs/lib.sh.
for root in "${RELAYMPI_ROOT-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR-}" "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/..}" ask; do
    [[ "$root" == ask && -n "${SLURM_JOB_ID-}" ]] && root="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/jobs/[^/]*$|\1|p' | head -n 1)"  # an array's last task lists them all
    [[ -n "$root" && -f "$root/jobs/lib.sh" ]] && source "$root/jobs/lib.sh" && relaympi_sweep sweep_agnews "$@"
done
echo "cannot find jobs/lib.sh: set RELAYMPI_ROOT to the relaympi checkout" >&2; exit 2

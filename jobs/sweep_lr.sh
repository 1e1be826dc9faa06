#!/bin/bash
#SBATCH --job-name=relaympi-lr
#SBATCH --array=0-449
#SBATCH --ntasks=16
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output=results/logs/%x-%A_%a.out
# Learning-rate grid search, lr = centre * 2^k (paper appendix 'Hyper-parameters and tuning').
# Written by `python -m jobs.grid scripts` from jobs/sweeps.py, where the grid lives: edit it there.
# Configurations: DRY_RUN=1 bash jobs/sweep_lr.sh. Submit: bash jobs/submit.sh sweep_lr
# (sizes the array from the grid, applies site settings, logs to RESULTS_DIR/logs/), or plain
# sbatch jobs/sweep_lr.sh from the checkout for the default grid (logs to results/logs/).
# Every setting is a RELAYMPI_* variable (jobs/README.md).
for root in "${RELAYMPI_ROOT-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR-}" \
    "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/..}" ask; do
    # ask: where SLURM says the script came from (an array's last task lists them all)
    [[ "$root" == ask && -n "${SLURM_JOB_ID-}" ]] &&
        root="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null |
            sed -n 's|^ *Command=\(.*\)/jobs/[^/]*$|\1|p' | head -n 1)"
    [[ -n "$root" && -f "$root/jobs/lib.sh" ]] && source "$root/jobs/lib.sh" &&
        relaympi_sweep sweep_lr "$@"
done
echo "cannot find jobs/lib.sh: set RELAYMPI_ROOT to the relaympi checkout" >&2; exit 2

#!/usr/bin/env bash
# Submit a sweep as SLURM job arrays sized from the grid, with the site settings applied.
#
#   bash jobs/submit.sh SWEEP [--all] [--dry-run] [--wait] [sbatch options ...]    (--help: the options)
#
# Only configurations whose run file is not completed/diverged are submitted (--all: every
# one; each job skips finished runs anyway). Configurations are grouped by their --ntasks
# (sweep_workers runs 16, 32 and 64 workers), one array per group. With --wait, waits for
# every array and exits with the highest exit status. Refuses (exit 2) when the data the jobs read
# is not present and verified under the data root (python -m relaympi.data check). Settings: jobs/README.md.
set -euo pipefail

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

usage() {
    echo "usage: bash jobs/submit.sh SWEEP [--all] [--dry-run] [--wait] [sbatch options ...]"
    echo "sweeps: sweep_alpha sweep_workers sweep_lr sweep_drop sweep_imagenet sweep_agnews"
}

show_help() {
    usage
    cat <<'EOF'

Submit a sweep as SLURM job arrays sized from its grid, with the site settings applied.

  --all       submit every configuration (default: only those whose run file is not
              completed or diverged; each job skips finished runs anyway)
  --dry-run   print the sbatch commands and check everything, submit nothing (also DRY_RUN=1)
  --wait      pass --wait to sbatch: wait for every array, exit with the highest exit status
  -h, --help  this help

Anything else goes to sbatch. Exit 2 when a configuration would be refused by the trainer, or
when the data the jobs read is not present and verified (python -m relaympi.data check; a dry
run only warns about data). Settings (RELAYMPI_* variables): jobs/README.md.
EOF
}

case "${1-}" in -h | --help) show_help; exit 0 ;; esac
[[ $# -ge 1 && "$1" != -* ]] || { usage >&2; exit 2; }
sweep="$1"
shift
[[ -f "$RELAYMPI_ROOT/jobs/$sweep.sh" ]] || { echo "no such sweep: $sweep" >&2; usage >&2; exit 2; }

plan_args=()
sbatch_args=()
wait=0
dry_run="${DRY_RUN:-0}"
[[ "$dry_run" == 0 || -z "$dry_run" ]] && dry_run=0 || dry_run=1
for arg in "$@"; do
    case "$arg" in
        --all) plan_args+=(--all) ;;
        --dry-run) dry_run=1 ;;
        --wait | -W) wait=1 ;;
        -h | --help) show_help; exit 0 ;;
        *) sbatch_args+=("$arg") ;;
    esac
done

[[ "$dry_run" == 0 ]] || plan_args+=(--dry-run)  # a dry run warns about missing data; a submission refuses

relaympi_setup
plan="$("$RELAYMPI_PY" "$RELAYMPI_ROOT/jobs/grid.py" plan "$sweep" ${plan_args[@]+"${plan_args[@]}"})"

# Site settings -> sbatch options (command-line options win over the script's #SBATCH lines).
site=()
add() { local value; value="$(relaympi_cfg "$1")"; [[ -z "$value" ]] || site+=("$2=$value"); }
add RELAYMPI_PARTITION --partition
add RELAYMPI_ACCOUNT --account
add RELAYMPI_QOS --qos
add RELAYMPI_TIME --time
add RELAYMPI_GPUS_PER_NODE --gpus-per-node
add RELAYMPI_NTASKS_PER_NODE --ntasks-per-node
add RELAYMPI_CPUS_PER_TASK --cpus-per-task
add RELAYMPI_MEM --mem
extra="$(relaympi_cfg RELAYMPI_SBATCH_ARGS)"
if [[ -n "$extra" ]]; then
    read -r -a extra_args <<<"$extra"
    site+=("${extra_args[@]}")
fi
max_parallel="$(relaympi_cfg RELAYMPI_MAX_PARALLEL)"
# options the jobs themselves need (jobs/grid.py plan: a GPU for RELAYMPI_BACKEND=batched)
while IFS=$'\t' read -r _ option; do
    [[ -z "$option" ]] || site+=("$option")
done < <(awk -F'\t' '$1 == "sbatch"' <<<"$plan")

logs="$(awk -F'\t' '$1 == "logs" {print $2}' <<<"$plan")"
finished="$(awk -F'\t' '$1 == "finished" {print $2}' <<<"$plan")"
groups="$(awk -F'\t' '$1 == "group"' <<<"$plan")"
if [[ -z "$groups" ]]; then
    echo "$sweep: nothing to submit (${finished:-0} configurations already finished)" >&2
    exit 0
fi
[[ "$dry_run" == 1 ]] || mkdir -p "$logs"

pids=()
while IFS=$'\t' read -r _ ntasks array count; do
    [[ -z "$max_parallel" ]] || array="$array%$max_parallel"
    cmd=(sbatch --array="$array" --ntasks="$ntasks" --output="$logs/%x-%A_%a.out"
        ${site[@]+"${site[@]}"} ${sbatch_args[@]+"${sbatch_args[@]}"})
    [[ "$wait" == 0 ]] || cmd+=(--wait)
    cmd+=("$RELAYMPI_ROOT/jobs/$sweep.sh")
    echo "$sweep: $count configuration(s) with --ntasks=$ntasks: $(printf '%q ' "${cmd[@]}")" >&2
    if [[ "$dry_run" == 1 ]]; then
        continue
    fi
    if [[ "$wait" == 1 ]]; then
        "${cmd[@]}" &
        pids+=("$!")
    else
        "${cmd[@]}"
    fi
done <<<"$groups"

status=0
for pid in ${pids[@]+"${pids[@]}"}; do
    rc=0
    wait "$pid" || rc=$?
    ((rc > status)) && status=$rc
done
exit "$status"

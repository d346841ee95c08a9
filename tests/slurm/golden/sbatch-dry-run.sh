#!/bin/bash
# trainpod job 0 on cluster sl: 2 node(s) + 1 hot spare(s).
# One trainpod agent per allocated node; the trainpod controller launches the
# workers and heals the job (rendered by trainpod; do not edit).
#SBATCH --job-name=tp-sl-0
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --partition=high
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=$STATE/jobs/0/slurm-%j.out
#SBATCH --signal=B:USR1@15
#SBATCH --time=30:00
#SBATCH --nice=10
#SBATCH --dependency=afterok:1
#SBATCH --exclude=node4

set -euo pipefail
export PYTHONUNBUFFERED=1
export TRAINPOD_ALLOCATION=0
export TRAINPOD_SLURM_NOTICE=$STATE/jobs/0"/slurm-notice-${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
# Slurm's preemption notice: tell the agents (a file; see trainpod.slurm.batch).
trap 'echo "trainpod: Slurm preemption notice ($(date +%s))"; date +%s >"$TRAINPOD_SLURM_NOTICE.tmp" && mv -f "$TRAINPOD_SLURM_NOTICE.tmp" "$TRAINPOD_SLURM_NOTICE"' USR1
echo "trainpod: allocation $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"
pids=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --nodelist="$node" --no-kill --unbuffered \
    $PYTHON -m trainpod.agent.main --state-dir $STATE --allocation 0 --group workers --log-dir $STATE/jobs/0 &
  pids+=("$!")
done
status=1
for pid in "${pids[@]}"; do
  while :; do
    rc=0 && wait "$pid" || rc=$?
    [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null || break
  done
  [ "$rc" -ne 0 ] || status=0
done
exit "$status"

#!/bin/bash
# trainpod job 5 on cluster c: 1 node(s).
# One trainpod agent per allocated node; the trainpod controller launches the
# workers and heals the job (rendered by trainpod; do not edit).
#SBATCH --job-name=tp-c-5
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --partition=debug
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=/srv/tp/jobs $(touch canary)/5/slurm-%j.out
#SBATCH --signal=B:USR1@15
#SBATCH --exclude=node[1-2]

set -euo pipefail
export PATH=/usr/bin:/bin
export SITE_NOTE='$(touch canary) `touch canary` '"'"'q'"'"' "d"'
export TRAINPOD_ALLOCATION=5
export TRAINPOD_SLURM_NOTICE='/srv/tp/jobs $(touch canary)/5'"/slurm-notice-${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
# Slurm's preemption notice: tell the agents (a file; see trainpod.slurm.batch).
trap 'echo "trainpod: Slurm preemption notice ($(date +%s))"; date +%s >"$TRAINPOD_SLURM_NOTICE.tmp" && mv -f "$TRAINPOD_SLURM_NOTICE.tmp" "$TRAINPOD_SLURM_NOTICE"' USR1
echo "trainpod: allocation $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"
pids=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --nodelist="$node" --no-kill --unbuffered \
    '/opt/py 3/bin/python' -m trainpod.agent.main --state-dir '/srv/tp/st'"'"'a te $(touch canary) `touch canary`' --allocation 5 --group workers --log-dir '/srv/tp/jobs $(touch canary)/5' &
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

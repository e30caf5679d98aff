#!/bin/bash
# Add Slurm worker jobs while a server wants more workers than it has.
#
#   PPSERVER_ADDRESS=tcp://trainhost:5555 deploy/slurm/autoscale.sh
#
# Runs beside the training (on the submit host, e.g. in the training job's
# own script, in the background). Every INTERVAL seconds it asks the server
# (`ppserver status --json`) for its pool: while `wanted` exceeds `current`
# (the server's pool is full and the workers hold the epoch back: see
# docs/operations.md, the pool) for PATIENCE polls in a row, and fewer than
# MAX_JOBS of its jobs are queued or running, it submits one more
# workers.sbatch job of one node with PPSERVER_PROCS=auto: the server then
# starts and retires that node's processes itself. It never cancels a job:
# the server retires processes it does not need; a node left with none ends
# with the job's time limit (or scancel it).
#
# Environment (workers.sbatch's too: PPSERVER_CONFIG, PPSERVER_KEYS, PPSERVER_BIN):
#   PPSERVER_ADDRESS  server control address tcp://HOST:PORT (required)
#   MAX_JOBS          most worker jobs at once (default 4)
#   INTERVAL          seconds between polls (default 30)
#   PATIENCE          polls in a row that must want more (default 2)
#   SBATCH_ARGS       more sbatch options, e.g. "--partition=cpu --time=4:00:00"

set -euo pipefail

address="${PPSERVER_ADDRESS:?set PPSERVER_ADDRESS=tcp://HOST:PORT}"
max_jobs="${MAX_JOBS:-4}"
interval="${INTERVAL:-30}"
patience="${PATIENCE:-2}"
bin="${PPSERVER_BIN:-ppserver}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
name="ppserver-workers-auto"
wanting=0

while true; do
    if pool="$("$bin" status "$address" --json --timeout 10 2>/dev/null |
        python3 -c 'import json, sys; p = json.load(sys.stdin)["pool"]; print(p["wanted"], p["current"])')"; then
        read -r wanted current <<<"$pool"
        if ((wanted > current)); then
            wanting=$((wanting + 1))
        else
            wanting=0
        fi
        jobs="$(squeue --noheader --user="$USER" --name="$name" --format=%i | wc -l)"
        if ((wanting >= patience && jobs < max_jobs)); then
            echo "autoscale.sh: the server wants $wanted workers, has $current: one more node ($((jobs + 1)) jobs)" >&2
            # shellcheck disable=SC2086
            PPSERVER_PROCS=auto sbatch --nodes=1 --job-name="$name" ${SBATCH_ARGS:-} "$here/workers.sbatch" "$address"
            wanting=0
        fi
    else
        echo "autoscale.sh: no status from $address" >&2
    fi
    sleep "$interval"
done

#!/usr/bin/env bash
# What the batch scripts (pretrain_gpt.sbatch, pretrain_gpt_per_task.sbatch) do once their training step has ended:
# requeue the job after a termination signal, or after a failure that a new run can get past (a lost rank: exit 4,
# a killed process, a torchrun that spent its restarts), within a cap. Sourced by the scripts; run directly it is
# a dry run of the failure decision, for checking a setting or a log by hand:
#
#   REQUEUE_ON_FAILURE=1 SLURM_RESTART_COUNT=1 scripts/slurm/requeue.sh <step exit code> [node logs...]
#
# prints `requeue: <why>` (exit 0) or `no requeue: <why>` (exit 1).
#
# Knobs (environment):
#   REQUEUE_ON_SIGNAL      1: requeue after the batch shell received a termination signal (default: 1)
#   REQUEUE_ON_FAILURE     1: requeue after the training step failed (default: 0); pass --save DIR --load DIR (and
#                          a --save-interval) so the requeued job resumes from the latest checkpoint
#   MAX_REQUEUES           no requeue after a failure once the job was requeued this many times, for whatever
#                          reason (SLURM_RESTART_COUNT; default: 3), so a fault that comes back cannot loop forever
#   NO_REQUEUE_EXIT_CODES  exit codes (of the step, or of a worker in torchrun's failure report) that a new run
#                          would repeat: 2 bad input, 3 non-finite loss, 5 a faulty rank (default: "2 3 5")

# Written to every node log before the step starts; the failure decision reads what follows the last one.
STEP_START_MARK="=== training step start:"

# mark_step_start LOG...: the start line in every node log of the step about to start.
mark_step_start() {
    local f
    for f in "$@"; do
        echo "$STEP_START_MARK job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} $(date '+%F %T')" >>"$f"
    done
}

# worker_exit_codes LOG...: the worker exit codes in torchrun's failure reports ("exitcode  : 4 (pid: ...)",
# negative for a signal) written since the last start line of each log.
worker_exit_codes() {
    local f
    for f in "$@"; do
        [[ -f "$f" ]] || continue
        awk -v mark="$STEP_START_MARK" '
            index($0, mark) == 1 { n = 0; next }
            /^ *exitcode *: *-?[0-9]+/ { sub(/^ *exitcode *: */, ""); codes[n++] = $1 }
            END { for (i = 0; i < n; i++) print codes[i] }' "$f"
    done
}

# failure_requeue_decision RC [WORKER_CODE...]: prints why; returns 0 to requeue the job after a step that ended
# with exit code RC (not 0), 1 not to.
failure_requeue_decision() {
    local rc="$1" code restarts="${SLURM_RESTART_COUNT:-0}" max="${MAX_REQUEUES:-3}"
    local repeat=" ${NO_REQUEUE_EXIT_CODES-2 3 5} "
    shift
    if [[ "${REQUEUE_ON_FAILURE:-0}" != 1 ]]; then
        echo "REQUEUE_ON_FAILURE is not 1"; return 1
    fi
    if ((restarts >= max)); then
        echo "the job was requeued $restarts times already (MAX_REQUEUES=$max)"; return 1
    fi
    for code in "$rc" "$@"; do
        if [[ "$repeat" == *" $code "* ]]; then
            echo "exit code $code comes back on every run (NO_REQUEUE_EXIT_CODES)"; return 1
        fi
    done
    echo "step exit code $rc, worker exit codes: ${*:-none reported}; requeue $((restarts + 1)) of at most $max"
}

# after_step RC SIGNALED LOG...: log the step's end and requeue the job when due; returns the batch script's exit
# code (0 once requeued: Slurm starts the job again).
after_step() {
    local rc="$1" signaled="$2" why
    shift 2
    log "training step ended with exit code $rc"
    if [[ -n "$signaled" ]]; then
        if [[ "${REQUEUE_ON_SIGNAL:-1}" == 1 ]]; then
            log "requeueing job $SLURM_JOB_ID; it resumes from --load"
            scontrol requeue "$SLURM_JOB_ID" || log "requeue failed (submitted without --requeue?)"
        fi
        return 0
    fi
    [[ "$rc" == 0 ]] && return 0
    # shellcheck disable=SC2046  # one code per word
    if why="$(failure_requeue_decision "$rc" $(worker_exit_codes "$@"))"; then
        log "requeueing job $SLURM_JOB_ID after a failure ($why); it resumes from --load"
        if scontrol requeue "$SLURM_JOB_ID"; then
            return 0
        fi
        log "requeue failed (submitted without --requeue?)"
    else
        log "not requeueing job $SLURM_JOB_ID after the failure: $why"
    fi
    return "$rc"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    if [[ $# -lt 1 ]]; then
        echo "usage: $0 <step exit code> [node logs...]" >&2
        exit 2
    fi
    step_rc="$1"
    shift
    # shellcheck disable=SC2046
    if why="$(failure_requeue_decision "$step_rc" $(worker_exit_codes "$@"))"; then
        echo "requeue: $why"
        exit 0
    fi
    echo "no requeue: $why"
    exit 1
fi

#!/usr/bin/env bash
# Start N processes of one command on this machine, as one jax.distributed job.
#   launch/local.sh N [--devices-per-process M | --gpus-per-process G] [--port P] [--restarts K] COMMAND...
# Each process gets ZAYA_COORDINATOR, ZAYA_NUM_PROCESSES, ZAYA_PROCESS_ID (read by
# zaya_jax.parallel.distributed.initialize). With --devices-per-process on a CPU machine, each
# process fakes M CPU devices (development and CI: collectives run over gloo). With
# --gpus-per-process on a GPU machine, process i sees only GPUs [i*G, (i+1)*G), so no two
# processes drive the same GPU: ROCR_VISIBLE_DEVICES on AMD (/dev/kfd exists; HIP_ and
# CUDA_VISIBLE_DEVICES are unset, since HIP would filter the renumbered list again),
# CUDA_VISIBLE_DEVICES otherwise; N > 1 on a machine with nvidia-smi or rocm-smi needs one of the two options.
# Output of process i goes to stdout prefixed "[i]". When a process fails, the others are stopped
# (a jax.distributed job cannot go on without it: they would wait in a collective) and, with
# --restarts K, the whole job starts again, at most K times (each start exports ZAYA_RESTART=0, 1, ...
# and takes a new coordinator port): a training run resumes from its newest checkpoint, the node-local
# tier's if checkpoint.local_dir is set. The script fails if the last start fails.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: launch/local.sh N [--devices-per-process M | --gpus-per-process G] [--port P] [--restarts K] COMMAND..." >&2
  exit 2
fi
num=$1; shift
[[ "$num" =~ ^[1-9][0-9]*$ ]] || { echo "launch/local.sh: N must be a positive integer, got '$num'" >&2; exit 2; }
devices=""; gpus=""; port=""; restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices-per-process) devices=$2; shift 2 ;;
    --gpus-per-process) gpus=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --restarts) restarts=$2; shift 2 ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "launch/local.sh: no command given" >&2; exit 2; }
[[ -z "$gpus" || "$gpus" =~ ^[1-9][0-9]*$ ]] || {
  echo "launch/local.sh: --gpus-per-process must be a positive integer, got '$gpus'" >&2; exit 2; }
[[ "$restarts" =~ ^[0-9]+$ ]] || {
  echo "launch/local.sh: --restarts must be a non-negative integer, got '$restarts'" >&2; exit 2; }
if [[ -z "$devices$gpus" && "$num" -gt 1 ]] && { command -v nvidia-smi || command -v rocm-smi; } >/dev/null 2>&1; then
  echo "launch/local.sh: this machine has GPUs; give --gpus-per-process G so that each of the $num processes" \
       "gets its own (otherwise every process sees every GPU)" >&2; exit 2
fi
start_job() {  # start_job PORT ATTEMPT COMMAND...: the N processes, their subshells' pids in `pids`
  local port=$1 attempt=$2
  shift 2
  pids=()
  for ((i = 0; i < num; i++)); do
    (
      export ZAYA_COORDINATOR="127.0.0.1:${port}" ZAYA_NUM_PROCESSES="$num" ZAYA_PROCESS_ID="$i" ZAYA_RESTART="$attempt"
      if [[ -n "$devices" ]]; then
        export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=${devices} ${XLA_FLAGS:-}"
      fi
      if [[ -n "$gpus" ]]; then
        visible=$(seq -s, $((i * gpus)) $(((i + 1) * gpus - 1)))
        if [[ -e "${ZAYA_KFD:-/dev/kfd}" ]]; then  # ZAYA_KFD: another path to test for (tests)
          unset CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES; export ROCR_VISIBLE_DEVICES="$visible"
        else
          export CUDA_VISIBLE_DEVICES="$visible"
        fi
      fi
      "$@" 2>&1 | sed -u "s/^/[$i] /"
      exit "${PIPESTATUS[0]}"
    ) &
    pids+=($!)
  done
}

descendants() {  # descendants PID: its children, theirs, ...
  local child
  for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done
}

stop_job() {  # every process of the job still running: each subshell, its command and all they started
  local pid tree=()
  for pid in "${pids[@]}"; do tree+=("$pid" $(descendants "$pid")); done
  kill -KILL "${tree[@]}" 2>/dev/null || true
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}

for ((attempt = 0; ; attempt++)); do
  start_job "${port:-$((20000 + RANDOM % 20000))}" "$attempt" "$@"
  failed="" running=("${pids[@]}")
  while ((${#running[@]})); do  # until one fails or all have ended well
    status=0 ended=""
    wait -n -p ended "${running[@]}" || status=$?
    if ((status)); then failed=$status; break; fi
    left=()
    for pid in "${running[@]}"; do [[ "$pid" == "$ended" ]] || left+=("$pid"); done
    running=("${left[@]}")
  done
  [[ -z "$failed" ]] && exit 0
  stop_job
  if ((attempt >= restarts)); then
    echo "launch/local.sh: a process exited with status $failed; the job is stopped" >&2; exit 1
  fi
  echo "launch/local.sh: a process exited with status $failed; the job is stopped and starts again" \
       "(restart $((attempt + 1)) of $restarts)" >&2
  port=""  # a new coordinator port: the last one may still be held
done

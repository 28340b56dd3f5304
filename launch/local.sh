#!/usr/bin/env bash
# Start N processes of one command on this machine, as one jax.distributed job.
#   launch/local.sh N [--devices-per-process M | --gpus-per-process G] [--port P] COMMAND...
# Each process gets ZAYA_COORDINATOR, ZAYA_NUM_PROCESSES, ZAYA_PROCESS_ID (read by
# zaya_jax.parallel.distributed.initialize). With --devices-per-process on a CPU machine, each
# process fakes M CPU devices (development and CI: collectives run over gloo). With
# --gpus-per-process on a GPU machine, process i sees only GPUs [i*G, (i+1)*G), so no two
# processes drive the same GPU: ROCR_VISIBLE_DEVICES on AMD (/dev/kfd exists; HIP_ and
# CUDA_VISIBLE_DEVICES are unset, since HIP would filter the renumbered list again),
# CUDA_VISIBLE_DEVICES otherwise; N > 1 on a machine with nvidia-smi or rocm-smi needs one of the two options.
# Output of process i goes to stdout prefixed "[i]"; the script fails if any process fails.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: launch/local.sh N [--devices-per-process M | --gpus-per-process G] [--port P] COMMAND..." >&2; exit 2
fi
num=$1; shift
[[ "$num" =~ ^[1-9][0-9]*$ ]] || { echo "launch/local.sh: N must be a positive integer, got '$num'" >&2; exit 2; }
devices=""; gpus=""; port=$((20000 + RANDOM % 20000))
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices-per-process) devices=$2; shift 2 ;;
    --gpus-per-process) gpus=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "launch/local.sh: no command given" >&2; exit 2; }
[[ -z "$gpus" || "$gpus" =~ ^[1-9][0-9]*$ ]] || {
  echo "launch/local.sh: --gpus-per-process must be a positive integer, got '$gpus'" >&2; exit 2; }
if [[ -z "$devices$gpus" && "$num" -gt 1 ]] && { command -v nvidia-smi || command -v rocm-smi; } >/dev/null 2>&1; then
  echo "launch/local.sh: this machine has GPUs; give --gpus-per-process G so that each of the $num processes" \
       "gets its own (otherwise every process sees every GPU)" >&2; exit 2
fi
pids=()
for ((i = 0; i < num; i++)); do
  (
    export ZAYA_COORDINATOR="127.0.0.1:${port}" ZAYA_NUM_PROCESSES="$num" ZAYA_PROCESS_ID="$i"
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
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status

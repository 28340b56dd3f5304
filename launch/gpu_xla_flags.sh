# XLA flags of the GPU jobs, sourced by slurm_h200.sbatch (`. launch/gpu_xla_flags.sh cuda`) and
# slurm_mi300x.sbatch (`... rocm`): MaxText's GPU set for hiding the data-parallel collectives
# (~0.44 s of all-gather and reduce-scatter per ZAYA1-base step at 1,024 GPUs) behind compute.
# XLA aborts at start on a flag it does not know: tests/test_launch.py starts jax with each
# platform's set, on the jax of both Python stacks.
zaya_xla_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true      # schedule async collectives to overlap compute
  --xla_gpu_enable_highest_priority_async_stream=true # collectives on a high-priority stream
  --xla_gpu_enable_pipelined_all_gather=true          # the next layer's FSDP all-gather under this layer
  --xla_gpu_enable_pipelined_reduce_scatter=true      # and its gradients' reduce-scatter
  --xla_gpu_enable_pipelined_all_reduce=true
  --xla_gpu_enable_while_loop_double_buffering=true   # the layer scan: prefetch across iterations
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728     # fewer, larger collectives (128 MiB)
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864  # 64 MiB
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_gpu_enable_triton_gemm=false                  # XLA's own GEMMs on cuBLAS / hipBLASLt
  --xla_disable_hlo_passes=rematerialization          # the model's remat policy decides (the planner's memory)
)
case "${1:-}" in
  cuda) ;;
  rocm) zaya_xla_flags+=(--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true) ;;  # ragged_dot on hipBLASLt
  *) echo "usage: . launch/gpu_xla_flags.sh cuda|rocm" >&2; return 2 2>/dev/null || exit 2 ;;
esac
export XLA_FLAGS="${XLA_FLAGS:-} ${zaya_xla_flags[*]}"
unset zaya_xla_flags

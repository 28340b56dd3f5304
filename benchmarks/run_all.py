"""Regenerates every CPU results file under benchmarks/results/ by running its script.

  python -m benchmarks.run_all [--only quantization_cpu,data_pipeline_cpu] [--list]

Each entry runs one benchmark script in a subprocess (a fresh JAX process, as a user would run
it), reads the one JSON object it prints on stdout, checks it parses, and writes it to
benchmarks/results/<name>.json. A script that fails or prints no JSON leaves its old file in
place and makes the command exit non-zero. Timings are only as good as the machine is quiet:
every script records the load average it saw. benchmarks/gpu/gpu_kernels.py (GPU only) writes its
own file and is not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import REPO, RESULTS

# results file name (without .json) -> module under benchmarks/ (python -m benchmarks.<module>) and arguments
RUNS: dict[str, list[str]] = {
    "bench_small_fwd_bwd_cpu": ["training.bench_small_fwd_bwd"],
    "chaos_cpu": ["checkpoints.chaos"],
    "blocks_vs_hf_cpu": ["training.blocks_vs_hf"],
    "checkpoint_save_cpu": ["checkpoints.checkpoint_save"],
    "checkpoint_tiers_cpu": ["checkpoints.checkpoint_tiers"],
    "data_pipeline_cpu": ["training.data_pipeline"],
    "demo_run_cpu_py311": ["demos.demo_run"],
    "demo_run_cpu_py312": ["demos.demo_run"],
    "newcomer_run_cpu_py311": ["demos.newcomer_run"],  # the README's install-and-train line on a clean clone
    "newcomer_run_cpu_py312": ["demos.newcomer_run"],
    "decode_cpu_torch2threads": ["serving.decode", "--torch-threads", "2"],
    "decode_cpu_torch1thread": ["serving.decode", "--torch-threads", "1"],
    "moe_layer_cpu": ["kernels.moe_layer"],
    "planner_vs_xla_cpu": ["planner.planner_vs_xla"],
    "quantization_cpu": ["kernels.quantization"],
    "step_profile_cpu": ["training.step_profile"],
    "train_step_cpu": ["training.train_step", "--muon"],
    "compiled_collectives_cpu": ["planner.compiled_collectives"],
    "planner_flops_vs_xla_cpu": ["planner.planner_flops_vs_xla"],
    "planner_predictions": ["planner.planner_predictions"],
    "planner_fp8_predictions": ["planner.planner_fp8"],  # ZAYA1-base bf16 vs model.matmul_precision=fp8
    "fp8_demo_cpu_py311": ["demos.fp8_demo"],  # the demo in bf16 and in FP8 (docs/fp8.md)
    "fp8_demo_cpu_py312": ["demos.fp8_demo"],
    "fp8_vs_qwix_cpu": ["training.fp8_vs_qwix"],  # FP8 training through Qwix 0.1.8 against ours and bf16 (docs/fp8.md)
    "serve_predictions": ["planner.serve_predictions"],  # the planner's --serve for ZAYA1-8B on one H200 / MI300X
    # the demos' figures differ by stack (the demo corpus holds that Python's standard library): each
    # runs under its own interpreter (STACK_SUFFIXES); GRPO starts from the SFT run of the same stack's
    # post-training demo, so the README's two tables share their baseline
    "posttrain_demo_cpu_py311": ["demos.posttrain_demo", "--workdir", "runs/posttrain_demo_py311"],
    "posttrain_demo_cpu_py312": ["demos.posttrain_demo", "--workdir", "runs/posttrain_demo_py312"],
    "grpo_demo_cpu_py311": ["demos.grpo_demo", "--sft", "runs/posttrain_demo_py311/demo_sft", "--seeds", "0,1,2"],
    "grpo_demo_cpu_py312": ["demos.grpo_demo", "--sft", "runs/posttrain_demo_py312/demo_sft", "--seeds", "0,1,2"],
    # the demo's SFT run exported as bf16, FP8 and MXFP4 checkpoints: held-out loss and exact match
    "quantized_checkpoints_cpu_py311": ["checkpoints.quantized_checkpoints", "--sft", "runs/posttrain_demo_py311/demo_sft"],
    "quantized_checkpoints_cpu_py312": ["checkpoints.quantized_checkpoints", "--sft", "runs/posttrain_demo_py312/demo_sft"],
    # GRPO's sampling, the engine against static generate, on that stack's SFT run (the GRPO demo's start)
    "grpo_rollouts_cpu_py311": ["serving.grpo_rollouts", "--checkpoint", "runs/posttrain_demo_py311/demo_sft"],
    "grpo_rollouts_cpu_py312": ["serving.grpo_rollouts", "--checkpoint", "runs/posttrain_demo_py312/demo_sft"],
    # lm-eval's generate_until through the engine (--slots) against its static batches
    "harness_generation_cpu_py311": ["serving.harness_generation", "--checkpoint", "runs/posttrain_demo_py311/demo"],
    "harness_generation_cpu_py312": ["serving.harness_generation", "--checkpoint", "runs/posttrain_demo_py312/demo"],
    # zaya_jax.generate(..., slots=8) against the static loop in batches of 8 (evaluate_tasks' way)
    "generate_slots_cpu_py311": ["serving.generate_slots"],
    "generate_slots_cpu_py312": ["serving.generate_slots"],
    "grpo_settings_cpu": ["demos.grpo_settings"],  # runs/demo_sft's GRPO variants (reuses runs/grpo_settings/*)
    "grpo_vs_trl_cpu": ["demos.grpo_vs_trl"],  # needs the bench extra (TRL) and runs/demo_sft (configs/demo_sft.py)
    "vl_demo_cpu_py311": ["demos.vl_demo"],
    "vl_demo_cpu_py312": ["demos.vl_demo"],
    "vl_demo_cpu_no_augmentation_py311": ["demos.vl_demo", *(f"--override=train.{o}" for o in (  # the demo as it was
        "steps=150", "augment_shift=0", "augment_scale=0", "augment_contrast=0"))],
    # the demo's narrower augmentation before issue #64 (shift 0.15, scale 0.25, contrast 0.3), 300 steps
    "vl_demo_cpu_previous_augmentation_py311": ["demos.vl_demo", *(f"--override=train.{o}" for o in (
        "steps=300", "augment_shift=0.15", "augment_scale=0.25", "augment_contrast=0.3"))],
    "xla_cpu_flags_cpu": ["ci.xla_cpu_flags"],
    "serve_soak_cpu_py311": ["serving.serve_soak", "--minutes", "2"],  # a server process under random load and disconnects
    # 2 CPU processes, one late at a collective; each file from its stack's interpreter (the script checks)
    "gloo_skew_cpu_py311": ["training.gloo_skew"],
    "gloo_skew_cpu_py312": ["training.gloo_skew"],
    # the engine against static batching (zaya_jax.generate; transformers on 3.11 only) at 3 arrival rates
    "serve_load_cpu_py311": ["serving.serve_load"],
    "serve_load_cpu_py312": ["serving.serve_load"],
    # model.moe_backend=auto picks the native CPU grouped matmul where the install built it
    # (zaya_jax.native); these files hold such runs and are only regenerated there
    "decode_cpu_torch1thread_native": ["serving.decode", "--torch-threads", "1"],
    "decode_cpu_torch2threads_native": ["serving.decode", "--torch-threads", "2"],
    "train_step_cpu_native": ["training.train_step", "--muon"],
    "allocator_cpu": ["training.allocator"],
    "harness_speed_cpu": ["serving.harness_speed"],
    "ci_suite_cpu": ["ci.ci_suite"],  # the whole .ci/run on a clean clone: as long as CI takes
    "ci_suite_cpu_loaded": ["ci.ci_suite", "--busy", "2"],  # the same at a load of about 4
    "suite_compile_level_cpu": ["ci.suite_compile_level"],  # the suite's -O0 compiles against the default
    "suite_profile_cpu": ["ci.suite_profile"],  # every test's time, by size and module
    # a test worker's memory mappings over the modules a 3.12 worker ran before it segfaulted,
    # with conftest's jax.clear_caches() after each module and without
    "worker_mappings_cpu_py312": ["ci.worker_mappings"],
}
NEEDS_NATIVE = {name for name in RUNS if name.endswith("_native")}
STACK_SUFFIXES = ("_py311", "_py312")  # a results name ending so is measured by that Python only
WRITES_ITS_OWN_FILE = {"chaos_cpu"}  # prints only a summary; its file holds the whole campaign


def json_output(stdout: str) -> dict:
    """The JSON object a script printed (everything from the first line that opens one)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
    if start is None:
        raise ValueError("printed no JSON object")
    return json.loads("\n".join(lines[start:]))


def wrong_stack(name: str) -> str | None:
    """Why this interpreter must not write results file `name` (one measured on another stack), or None."""
    from benchmarks.common import stack_suffix
    suffix = next((s for s in STACK_SUFFIXES if name.endswith(s)), None)
    if suffix is None or suffix == "_" + stack_suffix():
        return None
    venv = ".venv312" if suffix == "_py312" else ".venv"
    return (f"{name} is measured on Python {suffix[3]}.{suffix[4:]}; run it with that stack's interpreter "
            f"(the README's {venv}: {venv}/bin/python -m benchmarks.run_all --only {name})")


def run(name: str) -> dict:
    if (reason := wrong_stack(name)) is not None:
        raise RuntimeError(reason)
    if name in NEEDS_NATIVE:
        from zaya_jax.native import grouped_matmul
        if not grouped_matmul.available():
            raise RuntimeError("needs the native CPU grouped matmul, which this install did not build")
    module, *args = RUNS[name]
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], env=env,
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"benchmarks.{module} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    result = json_output(done.stdout)
    if name in WRITES_ITS_OWN_FILE:
        with open(os.path.join(RESULTS, name + ".json")) as f:
            return json.load(f)
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated results names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the results names and their commands")
    args = parser.parse_args()
    if args.list:
        for name, command in RUNS.items():
            print(f"{name}: python -m benchmarks.{' '.join(command)}")
        return 0
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        print(f"--only: unknown results name {unknown[0]!r} (known: {', '.join(RUNS)})", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"{name} ...", flush=True)
        try:
            run(name)
        except (RuntimeError, ValueError) as err:
            print(f"{name}: {err}", file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""One GRPO step (generation + update) of zaya_jax against TRL's GRPOTrainer on this CPU. Prints JSON.

  python -m benchmarks.demos.grpo_vs_trl [--sft runs/demo_sft] [--steps 6] [--torch-threads 2] [--workdir DIR]

The same weights on both sides: --sft (a finished run of configs/demo_sft.py) is exported with
`python -m zaya_jax.convert to_hf` for TRL, and zaya_jax starts from it by
`python -m zaya_jax.train --config configs/demo_grpo.py --config.train.init_from_checkpoint=SFT`
(a subprocess, --steps steps, a train record every step). TRL's GRPOTrainer (needs the `bench`
extra: pip install -e '.[bench]') runs the export in this process, in float32, with the settings
of configs/demo_grpo.py: 16 prompts x G=8 completions per step (per_device_train_batch_size =
generation_batch_size = 128 completions, one generation per optimizer step), at most 8 completion
tokens, temperature 1, beta 0, loss_type dapo, learning rate 1e-3 constant, no gradient
checkpointing (zaya_jax's demo has no remat), no vLLM. Prompts: the demo's training questions
(grpo_prompts.demo_records('train', 0, 0), what demo:tasks holds) rendered with the exported
chat template (checked here to give zaya_jax's prompt tokens); reward: grpo_rewards.exact_answer.

Per-step seconds leave out the first step (compilation on zaya_jax's side, first calls on
TRL's) and are the median of the rest: zaya_jax's from its metrics.jsonl (each record's
generation_s + update_s, a window of one step), TRL's from a TrainerCallback (on_step_begin to
on_step_end), its generation being the time in GRPOTrainer._generate_and_score_completions
(sampling, decoding, rewards, advantages; zaya_jax's generation_s counts the same). The sides
run one after the other, never at once: zaya_jax (the shorter run) before and after TRL, its
steps of both runs pooled; the load average (the 2 cores are shared) is recorded between runs.

Not the same on both sides, and reported: zaya_jax pads every row to fixed shapes (the prompt to
grpo.max_prompt_length, the completion to max_completion_length: one compiled step), TRL to the
batch's longest prompt and completion (its padded widths are recorded); the optimizer is
configs/demo_grpo.py's (Muon + AdamW) against TRL's AdamW. Both hand a conversational prompt's
completions to the reward as the assistant's message, which exact_answer reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import REPO  # noqa: E402

from benchmarks.demos.posttrain_demo import run  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.train.monitor import read_metrics  # noqa: E402

PROMPTS_PER_STEP, G, T = 16, 8, 8  # the measured step's shape: configs/demo_grpo.py with these overrides
LEARNING_RATE = 1e-3  # and its optimizer as measured: Muon + AdamW (the demo itself trains with AdamW)


def zaya_jax_steps(sft: str, workdir: str, steps: int) -> list[dict]:
    """Trains configs/demo_grpo.py from `sft` for `steps` steps -> its train records."""
    run(["zaya_jax.train", "--config", os.path.join(REPO, "configs", "demo_grpo.py"), "--workdir", workdir,
         f"--config.train.init_from_checkpoint={sft}", f"--config.train.steps={steps}",
         "--config.train.log_every_steps=1", "--config.eval.every_steps=0",
         f"--config.grpo.prompts_per_step={PROMPTS_PER_STEP}", f"--config.grpo.num_generations={G}",
         f"--config.grpo.max_completion_length={T}", "--config.optimizer.name=muon",
         f"--config.optimizer.learning_rate={LEARNING_RATE}",
         "--config.monitor.progress_bar=False", "--config.monitor.tensorboard=False"])
    return read_metrics(os.path.join(workdir, "metrics.jsonl"))


def check_prompt_tokens(hf_dir: str, tokenizer, records: list[dict], n: int = 256) -> int:
    """TRL's rendering of the first `n` prompts (the export's tokenizer and chat template) equals
    zaya_jax's (encode_prompt with the plain template, what demo:tasks feeds) -> n; raises otherwise."""
    from zaya_jax.data import chat_template
    from zaya_jax.data.tokenizer import Tokenizer
    ours = Tokenizer(os.path.join(hf_dir, "tokenizer.json"), bos_id=tokenizer.bos_token_id,
                     eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    template = chat_template.ChatTemplate.load(chat_template.PLAIN)
    prompts = [r["prompt"] for r in records[:n]]
    theirs = tokenizer.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    for prompt, ids in zip(prompts, theirs, strict=True):
        mine = chat_template.encode_prompt(template, ours, prompt).tolist()
        if list(ids) != mine:
            raise RuntimeError(f"prompt tokens differ for {prompt}: TRL {list(ids)}, zaya_jax {mine}")
    return len(prompts)


def trl_steps(hf_dir: str, workdir: str, steps: int, torch_threads: int) -> dict:
    """GRPOTrainer on the export for `steps` steps -> per-step seconds, generation seconds, widths."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback, ZayaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from zaya_jax.train.grpo_prompts import demo_records
    from zaya_jax.train.grpo_rewards import exact_answer

    torch.set_num_threads(torch_threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    records = demo_records("train", 0, 0)
    checked = check_prompt_tokens(hf_dir, tokenizer, records)

    rows = PROMPTS_PER_STEP * G
    config = GRPOConfig(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=G, max_completion_length=T, temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, loss_type="dapo", epsilon=0.2, scale_rewards="group", num_iterations=1,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1,
        max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        log_completions=False)
    model = ZayaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_answer], args=config,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer)

    times = {"step": [], "generation": [], "widths": []}
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs):
        start = time.perf_counter()
        out = generate(inputs)
        times["generation"][-1] += time.perf_counter() - start
        times["widths"][-1] = [int(out["prompt_ids"].shape[1]), int(out["completion_ids"].shape[1]),
                               int(out["prompt_ids"].shape[0])]
        return out
    trainer._generate_and_score_completions = timed_generate

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            times["generation"].append(0.0)
            times["widths"].append(None)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimes())
    with contextlib.redirect_stdout(sys.stderr):  # its printed logs, so that stdout holds one JSON object
        trainer.train()
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    return {**times, "prompts_checked": checked, "torch_threads": torch.get_num_threads(), "rewards": rewards}


def median(values) -> float:
    return round(statistics.median(values), 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default=os.path.join(REPO, "runs", "demo_sft"),
                        help="a finished run of configs/demo_sft.py (default: runs/demo_sft)")
    parser.add_argument("--steps", type=int, default=6, help="steps per side; the first is left out")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--workdir", default="", help="where the export and runs go (default: a temporary dir)")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.sft, "checkpoints")):
        sys.exit(f"--sft {args.sft}: no checkpoints there; train it: "
                 "python -m zaya_jax.train --config configs/demo_sft.py --workdir runs/demo_sft")
    import jax
    import torch
    import transformers
    import trl

    workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_vs_trl_")
    load = [os.getloadavg()[0]]
    hf_dir = os.path.join(workdir, "sft_hf")
    run(["zaya_jax.convert", "to_hf", "--checkpoint", args.sft, "--out", hf_dir])
    # zaya_jax before and after TRL (its run is the shorter), so that both see the load TRL saw
    before = zaya_jax_steps(args.sft, os.path.join(workdir, "zaya_jax_before"), args.steps)
    load.append(os.getloadavg()[0])
    theirs = trl_steps(hf_dir, os.path.join(workdir, "trl"), args.steps, args.torch_threads)
    load.append(os.getloadavg()[0])
    after = zaya_jax_steps(args.sft, os.path.join(workdir, "zaya_jax_after"), args.steps)
    load.append(os.getloadavg()[0])
    first, records = before[0], before[1:] + after[1:]
    prompt_width = load_config_file(os.path.join(REPO, "configs", "demo_grpo.py")).grpo.max_prompt_length

    ours_step = [r["generation_s"] + r["update_s"] for r in records]
    ours_gen = [r["generation_s"] for r in records]
    trl_step, trl_gen = theirs["step"][1:], theirs["generation"][1:]
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    zaya, trl_s = median(ours_step), median(trl_step)
    print(json.dumps({
        "what": "one GRPO step (generate G completions of P prompts, reward, advantages, one optimizer step) of "
                "the SFT demo model: zaya_jax's trainer (configs/demo_grpo.py) against TRL's GRPOTrainer on "
                "its HF export, same weights, prompts, G, T and reward; medians over the steps after the first",
        "sft": args.sft, "steps_run": args.steps, "runs": {"zaya_jax": 2, "trl": 1},
        "steps_measured": {"zaya_jax": len(ours_step), "trl": len(trl_step)},
        "shapes": {"prompts_per_step": PROMPTS_PER_STEP, "num_generations": G, "completions_per_step": PROMPTS_PER_STEP * G, "max_completion_length": T,
                   "zaya_jax_row_width": prompt_width + T - 1, "zaya_jax_max_prompt_length": prompt_width,
                   "trl_padded_prompt_completion_rows": theirs["widths"][1:]},
        "model": {k: hf[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")},
        "zaya_jax": {"step_s": zaya, "generation_s": median(ours_gen), "update_s": median(r["update_s"] for r in records),
                     "step_s_before_after_trl": [median(ours_step[:args.steps - 1]), median(ours_step[args.steps - 1:])],
                     "steps_s": [round(x, 3) for x in ours_step], "generation_steps_s": [round(x, 3) for x in ours_gen],
                     "first_step_s": round(first["generation_s"] + first["update_s"], 3), "reward": [round(r["reward"], 4) for r in records],
                     "optimizer": f"muon + adamw at {LEARNING_RATE} (configs/demo_grpo.py's overridden)"},
        "trl": {"step_s": trl_s, "generation_s": median(trl_gen),
                "update_s": median(s - g for s, g in zip(trl_step, trl_gen)),
                "steps_s": [round(x, 3) for x in trl_step], "generation_steps_s": [round(x, 3) for x in trl_gen],
                "first_step_s": round(theirs["step"][0], 3), "reward": [round(x, 4) for x in theirs["rewards"][1:]],
                "optimizer": "adamw_torch", "torch_threads": theirs["torch_threads"],
                "generation_split": "time inside GRPOTrainer._generate_and_score_completions (sampling, "
                                    "decoding, rewards, advantages); update = the rest of the step"},
        "ratio_zaya_jax_over_trl": round(zaya / trl_s, 3), "speedup_of_zaya_jax": round(trl_s / zaya, 3),
        "ratio_generation": round(median(ours_gen) / median(trl_gen), 3),
        "prompt_tokens_equal_checked": theirs["prompts_checked"],
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "trl": trl.__version__},
        "jax_devices": f"{jax.device_count()} x {jax.devices()[0].platform} (default threads)",
        "load_average_1min_start_after_zaya_after_trl_end": [round(x, 2) for x in load],
    }, indent=2))


if __name__ == "__main__":
    main()

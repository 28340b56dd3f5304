"""The README's demo model exported as FP8 and MXFP4 checkpoints against bf16: held-out loss and
exact-match accuracy. Prints JSON.

  python -m benchmarks.checkpoints.quantized_checkpoints [--sft runs/demo_sft] [--workdir DIR]

The demo (configs/demo.py pretraining, then configs/demo_sft.py from it, as the README runs them;
or --sft, a finished SFT run) is exported with `python -m zaya_jax.convert to_hf` three ways: float32,
`--quantize fp8 --fp8_block 32` (transformers' FineGrainedFP8 layout; the demo's 32-wide heads: the
default 128 would leave its key and value projections in float) and `--quantize mxfp4` (its experts
in MXFP4). Each export is read back as a user's `generate --hf` reads it (zaya_jax.infer.load_hf:
the FP8 / MXFP4 weights stay quantized, dequantized inside the computation) and computes in
bfloat16; "bf16" is the float export so computed. Held-out loss: the SFT config's held-out batches
(zaya_jax.train.data.eval_batches: the assistant tokens of held-out chats), mean nll over the
supervised tokens. Exact-match accuracy: evaluate_tasks' 500 held-out questions answered by greedy
generation (zaya_jax.evaluation.tasks.answer_tasks, score), with the run's chat template. Also the
bytes of the weights (quantized ones: values and scales; every float one as bf16) and the load average: the
2 CPU cores may be shared. The stack is recorded: the demo data, and so every figure, differs
between Python 3.11 and 3.12 (quantized_checkpoints_cpu_py311.json / _py312.json).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.common import REPO  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import stack  # noqa: E402
from benchmarks.demos.posttrain_demo import run, sft_run  # noqa: E402
from zaya_jax.config_files import load_config_file  # noqa: E402
from zaya_jax.data import instruction_tasks  # noqa: E402
from zaya_jax.data.tokenizer import Tokenizer  # noqa: E402
from zaya_jax.evaluation.answering import BATCH_SIZE, MAX_NEW_TOKENS, run_template  # noqa: E402
from zaya_jax.evaluation.tasks import answer_tasks, score  # noqa: E402
from zaya_jax.infer import load_hf  # noqa: E402
from zaya_jax.checkpoints.quantize import QuantizedWeight  # noqa: E402
from zaya_jax.train.data import eval_batches  # noqa: E402
from zaya_jax.train.settings import settings_from_config  # noqa: E402

EXPORTS = {"bf16": (), "fp8": ("--quantize", "fp8", "--fp8_block", "32"), "mxfp4": ("--quantize", "mxfp4")}


def heldout_loss(model, batches: dict) -> float:
    """Mean nll of the supervised tokens (loss_mask) over every held-out batch of every source."""
    forward = jax.jit(lambda m, b: m(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"]))
    total = count = 0.0
    for source in batches.values():
        for batch in source:
            logp = jax.nn.log_softmax(forward(model, batch).astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], axis=-1)[..., 0]
            total += float(jnp.sum(nll * batch["loss_mask"]))
            count += float(np.sum(batch["loss_mask"]))
    return total / count


def weight_bytes(model) -> int:
    """Bytes of the weights with every float one in bf16: quantized ones count their values and scales."""
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        total += (value.values.nbytes + value.scales.nbytes if isinstance(value, QuantizedWeight) else 2 * value.size)
    return int(total)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="", help="a finished run of configs/demo_sft.py (default: train the demo)")
    parser.add_argument("--workdir", default="", help="where the runs and exports go (default: a temporary dir)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    config = load_config_file(os.path.join(REPO, "configs", "demo_sft.py"))
    batches = eval_batches(config, settings_from_config(config))
    tasks = instruction_tasks.tasks("heldout", 100, 0)
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.workdir or tmp)
        sft = sft_run(root, args.sft)
        template = run_template(sft, None)
        results = {}
        for name, flags in EXPORTS.items():
            out = os.path.join(root, f"export_{name}")
            run(["zaya_jax.convert", "to_hf", "--checkpoint", sft, "--out", out, *flags])
            model = load_hf(out, dtype="bfloat16")
            tokenizer = Tokenizer(os.path.join(out, "tokenizer.json"), bos_id=model.config.bos_token_id,
                                  eos_id=model.config.eos_token_id, pad_id=model.config.pad_token_id)
            scored = score(tasks, answer_tasks(model, tokenizer, template, tasks, MAX_NEW_TOKENS, BATCH_SIZE))
            results[name] = {"heldout_loss": round(heldout_loss(model, batches), 4),
                             "accuracy": scored["accuracy"], "accuracy_by_kind": scored["accuracy_by_kind"],
                             "weight_bytes_bf16_floats": weight_bytes(model)}
    print(json.dumps({
        "stack": stack(), "model": "configs/demo_sft.py after configs/demo.py", "sft_reused": bool(args.sft),
        "compute_dtype": "bfloat16", "fp8_block": 32, "heldout_questions": len(tasks), "results": results,
        "cpu_count": os.cpu_count(), "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()

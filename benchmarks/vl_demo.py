"""The README's vision-language demo, measured: held-out digit accuracy, and the text model untouched. Prints JSON.

  python benchmarks/vl_demo.py [--pretrained runs/demo] [--workdir DIR]

Trains configs/demo_vl.py as a user would (`python -m zaya_jax.train`, in its own process) from
the pretraining demo's run (--pretrained, or trains configs/demo.py first), then scores the 360
held-out digits by greedy generation (zaya_jax.vision.digit_accuracy; chance is 10%), once with
the images and once with every image black (the same prompts without what the images show), and
compares the run's text model with the one it started from: their weights, and their held-out
loss on the demo corpus's text (2 evaluation batches per source; the run freezes the text model,
so the two must be equal). Reports the run's wall time (including compilation), its final
training and evaluation records (image_token_share among them) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.posttrain_demo import final_metrics, train  # noqa: E402


def text_heldout_loss(model, batches: dict) -> dict:
    """{source: mean next-token nll} of a text model over the demo corpus's held-out batches."""
    import jax.numpy as jnp
    out = {}
    for source, rows in batches.items():
        total, count = 0.0, 0.0
        for batch in rows:
            logits = np.asarray(model(jnp.asarray(batch["inputs"]), segment_ids=jnp.asarray(batch["segment_ids"])),
                                np.float64)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
            total += float((nll * batch["loss_mask"]).sum())
            count += float(batch["loss_mask"].sum())
        out[source] = round(total / count, 6)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default="", help="a finished run of configs/demo.py (default: train one)")
    parser.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    from zaya_jax.config_files import image_processor
    from zaya_jax.data import build_eval_batches, chat_template, demo_data_config
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.train.carried_tokenizer import checkpoint_tokenizer
    from zaya_jax.train.checkpoint import load_checkpoint_model, read_config, checkpoint_dir
    from zaya_jax.vision.demo_images import digit_conversations
    from zaya_jax.vision.digit_accuracy import digit_accuracy
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.workdir or tmp)
        text_run, vl_run = os.path.join(root, "demo"), os.path.join(root, "demo_vl")
        if args.pretrained:
            text_run, pretrain_wall = os.path.abspath(args.pretrained), None
        else:
            pretrain_wall = train("demo.py", text_run, None)
        vl_wall = train("demo_vl.py", vl_run, text_run)
        vl, vl_step = load_checkpoint_model(vl_run)
        text, _ = load_checkpoint_model(text_run)
        cfg = vl.text.config
        tokenizer = Tokenizer(checkpoint_tokenizer(vl_run)[0], bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id,
                              pad_id=cfg.pad_token_id)
        processor = image_processor(read_config(checkpoint_dir(vl_run)))
        template = chat_template.ChatTemplate.load(chat_template.PLAIN)
        heldout = digit_conversations("heldout")
        with_images = digit_accuracy(vl, tokenizer, processor, heldout, template)
        blank = digit_accuracy(vl, tokenizer, processor, heldout, template, blank=True)
        from zaya_jax.train.state import ModelParts, without_vision_lora
        vl_text = without_vision_lora(ModelParts.arrays(vl.text)[0])
        start_text = ModelParts.arrays(text)[0]
        weight_change = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                            for a, b in zip(jax.tree.leaves(vl_text), jax.tree.leaves(start_text)))
        batches = build_eval_batches(demo_data_config(), max_batches=2)
        frozen_text_model = vl.text
        loss_before, loss_after = text_heldout_loss(text, batches), text_heldout_loss(frozen_text_model, batches)
        metrics = final_metrics(vl_run)
    print(json.dumps({
        "heldout_digit_accuracy": with_images["accuracy"], "heldout_digits": with_images["questions"],
        "accuracy_with_black_images": blank["accuracy"], "chance": 0.1,
        "accuracy_by_digit": with_images["by_digit"], "answers_with_images": with_images["answers"],
        "answers_with_black_images": blank["answers"],
        "text_model": {"max_abs_weight_change": weight_change, "heldout_loss_before": loss_before,
                       "heldout_loss_after": loss_after},
        "steps": vl_step, "wall_s_including_compile": {"pretrain": pretrain_wall, "vl": vl_wall},
        "pretrain_reused": bool(args.pretrained), "vl_final": metrics,
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()

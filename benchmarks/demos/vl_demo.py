"""The README's vision-language demo, measured over seeds: held-out digit accuracy on plain digits and
each held-out variant (demo_images.VARIANTS), and the text model untouched. Prints JSON.

  python -m benchmarks.demos.vl_demo [--pretrained runs/demo] [--workdir DIR] [--seeds 0,1]

Trains configs/demo_vl.py as a user would (`python -m zaya_jax.train`, in its own process) from
the pretraining demo's run (--pretrained, or trains configs/demo.py first) once per seed
(`--config.train.seed`: the tower's initialisation, the data order and the training images'
augmentation), then scores each run as `python -m zaya_jax.evaluate_tasks --checkpoint RUN` does
(evaluation.digit_accuracy.score_vision_run: the 359 held-out digits by greedy generation as they are, moved
by one pixel and by two along each axis, drawn at another size and at 6 of 8 pixels, at 60% contrast,
and with every image black; chance is 10%), and compares
each run's text model with the one it started from: their weights, and their held-out loss on the
demo corpus's text (2 evaluation batches per source; the run freezes the text model, so the two
must be equal). `--override` changes every VL run's config (benchmarks/run_all.py's
vl_demo_cpu_no_augmentation_py311: the demo as it was, 150 steps without augmentation). Reports each
run's wall time (including compilation) with the load average around it, its final training and
evaluation records (image_token_share among them), the accuracies' mean, range and spread over
the seeds, and the Python and jax versions: the demo corpus, and so the pretrained run, differ per
Python (run_all keeps one results file per stack).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import jax
import numpy as np


from benchmarks.demos.posttrain_demo import final_metrics, train  # noqa: E402


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


def text_model_change(vl, text, batches: dict) -> dict:
    """The largest change of a text weight between the text run and the VL run's text model (the vision
    LoRA left out), and both models' held-out text loss."""
    from zaya_jax.checkpoints.model_parts import ModelParts
    from zaya_jax.train.state import without_vision_lora
    vl_text = without_vision_lora(ModelParts.arrays(vl.text)[0])
    start_text = ModelParts.arrays(text)[0]
    change = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(vl_text), jax.tree.leaves(start_text)))
    return {"max_abs_weight_change": change, "heldout_loss_before": text_heldout_loss(text, batches),
            "heldout_loss_after": text_heldout_loss(vl.text, batches)}


def spread(values: list[float]) -> dict:
    """Mean, range and sample standard deviation (0 for one value) of per-seed figures."""
    return {"mean": round(float(np.mean(values)), 4), "min": min(values), "max": max(values),
            "std": round(float(np.std(values, ddof=1)) if len(values) > 1 else 0.0, 4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default="", help="a finished run of configs/demo.py (default: train one)")
    parser.add_argument("--workdir", default="", help="where the runs go (default: a temporary dir)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated train.seed of each VL run")
    parser.add_argument("--override", action="append", default=[],
                        help="a config override of every VL run, e.g. --override=train.augment_shift=0 (repeatable)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    load_start = os.getloadavg()[0]
    from zaya_jax.data import build_eval_batches, demo_data_config
    from zaya_jax.evaluation.answering import MAX_NEW_TOKENS, load_checkpoint, run_template
    from zaya_jax.evaluation.digit_accuracy import score_vision_run
    from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.workdir or tmp)
        text_run = os.path.join(root, "demo")
        if args.pretrained:
            text_run, pretrain_wall = os.path.abspath(args.pretrained), None
        else:
            pretrain_wall = train("demo.py", text_run, None)
        text, _ = load_checkpoint_model(text_run)
        batches = build_eval_batches(demo_data_config(), max_batches=2)
        for seed in seeds:
            vl_run = os.path.join(root, f"demo_vl_seed{seed}")
            load = os.getloadavg()[0]
            wall = train("demo_vl.py", vl_run, text_run, f"--config.train.seed={seed}",
                         *(f"--config.{o}" for o in args.override))
            load = [round(load, 2), round(os.getloadavg()[0], 2)]
            vl, step, tokenizer = load_checkpoint(vl_run, None, vision=True)
            scored = score_vision_run(vl_run, step, vl, tokenizer, run_template(vl_run, None))
            runs.append({
                "seed": seed, "steps": step, "wall_s_including_compile": wall, "load_average_1m_start_end": load,
                "accuracy_by_variant": scored["accuracy_by_variant"],
                "accuracy_with_black_images": scored["accuracy_with_black_images"],
                "accuracy_by_digit": scored["variants"]["plain"]["by_digit"],
                "answers": {v: r["answers"][:4] for v, r in scored["variants"].items()}
                | {"black_images": scored["black_images"]["answers"][:4]},
                "text_model": text_model_change(vl, text, batches), "vl_final": final_metrics(vl_run)})
    variants = runs[0]["accuracy_by_variant"]
    print(json.dumps({
        "python": platform.python_version(), "jax": jax.__version__, "seeds": seeds, "overrides": args.override,
        "heldout_digits": scored["questions"], "chance": 0.1, "max_new_tokens": MAX_NEW_TOKENS,
        "accuracy_over_seeds": {v: spread([r["accuracy_by_variant"][v] for r in runs]) for v in variants}
        | {"black_images": spread([r["accuracy_with_black_images"] for r in runs])},
        "wall_s_including_compile": {"pretrain": pretrain_wall,
                                     "vl_over_seeds": spread([r["wall_s_including_compile"] for r in runs])},
        "pretrain_reused": bool(args.pretrained), "runs": runs,
        "cpu_count": os.cpu_count(), "machine": "shared with other jobs; timings are indicative",
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }, indent=2))


if __name__ == "__main__":
    main()

"""lm-evaluation-harness scoring speed: zaya_jax's harness model against the harness's own `hf` backend
(transformers + PyTorch) on one demo-shaped HF export and the same requests, timed alternately in one
process. Prints JSON and writes benchmarks/results/harness_speed_cpu.json.

  python -m benchmarks.serving.harness_speed [--limit 40] [--batch-size 8] [--repeats 3]

The export: configs/demo.py's model (4 layers of width 128, 8 experts, vocab 4096), randomly
initialised, with the demo corpus's tokenizer (`convert to_hf`). The requests: the loglikelihood
requests of the bundled demo tasks zaya_demo_cloze and zaya_demo_questions_mc, and the
loglikelihood_rolling requests of zaya_demo_heldout_prose (`--limit` documents each), built by
lm_eval's own tasks. Tokens scored: the positions both backends score (the same requests, so the
same count: each request's input tokens), over each side's median seconds after a warm-up call
(zaya_jax compiles there), per request type and in all. Also reports how far the two sides' scores
differ (max |difference| of a request's log-likelihood; for rolling, of a document's sum over ~1000 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from benchmarks.common import alternate_times, print_and_save  # noqa: E402

from benchmarks.common import REPO  # noqa: E402
LOGLIKELIHOOD_TASKS = ("zaya_demo_cloze", "zaya_demo_questions_mc")
ROLLING_TASKS = ("zaya_demo_heldout_prose",)
# A random router is near uniform: its top-1 choice often wins by less than float32 noise (gaps of
# 1e-7 on the demo model), so the two frameworks route some token differently and its log-prob then
# differs by ~1e-3. The router's output weights scaled up make the choices as decisive as a trained
# router's, so the scores compare the numerics and not the coin flips.
ROUTER_SCALE = 30.0


def demo_export(directory: str) -> str:
    """configs/demo.py's model, random (router scaled by ROUTER_SCALE), saved as a run's checkpoint
    would be and exported to HF."""
    from zaya_jax.config_files import load_config_file, model_config
    from zaya_jax.convert.conversions import to_hf
    from zaya_jax.data.sources import tokenizer_path
    from zaya_jax.model.build import create_model
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    config = load_config_file(os.path.join(REPO, "configs", "demo.py"))
    cfg = model_config(config)
    params, biases = ModelParts.arrays(create_model(cfg, seed=0))
    router = params["layers"]["moe"]["router"]
    router["out_proj"] = router["out_proj"] * ROUTER_SCALE
    save_model(os.path.join(directory, "ckpt"), params, biases,
               {"model": dataclasses.asdict(cfg), "data": {"tokenizer": tokenizer_path(config.data)}})
    return to_hf(os.path.join(directory, "ckpt"), os.path.join(directory, "hf"))


def task_requests(limit: int) -> dict[str, list]:
    """{request type: [Instance]} of the demo tasks, as simple_evaluate builds them."""
    from lm_eval.tasks import get_task_dict

    from zaya_jax.harness.tasks import task_manager
    built: dict[str, list] = {"loglikelihood": [], "loglikelihood_rolling": []}
    for task in get_task_dict([*LOGLIKELIHOOD_TASKS, *ROLLING_TASKS], task_manager()).values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        for instance in task.instances:
            built[instance.request_type].append(instance)
    return built


def serve(lm, kind: str, requests: list) -> list[float]:
    """Every request's log-likelihood."""
    if kind == "loglikelihood":
        return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    return list(lm.loglikelihood_rolling(requests, disable_tqdm=True))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=40, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    import jax
    import torch
    from lm_eval.models.huggingface import HFLM

    from zaya_jax.harness.model import ZayaHarnessLM
    from zaya_jax.model.kernels import resolve_moe_backend
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = demo_export(tmp)
        ours = ZayaHarnessLM(hf=hf_dir, batch_size=args.batch_size)
        theirs = HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=args.batch_size)
        requests = task_requests(args.limit)
        rows = {kind: measure(ours, theirs, kind, batch, args.repeats) for kind, batch in requests.items()}
    tokens = sum(r["tokens_scored"] for r in rows.values())
    zaya, hf = (sum(r[f"{side}_s"] for r in rows.values()) for side in ("zaya_jax", "hf_torch"))
    print_and_save({
        "export": f"configs/demo.py model, random init, router out_proj x{ROUTER_SCALE}, demo corpus tokenizer "
                  "(convert to_hf)",
        "tasks": {"loglikelihood": list(LOGLIKELIHOOD_TASKS), "loglikelihood_rolling": list(ROLLING_TASKS)},
        "requests": {kind: len(r) for kind, r in requests.items()}, "limit": args.limit,
        "batch_size": args.batch_size, "tokens_scored": tokens,
        "zaya_jax_s": round(zaya, 3), "hf_torch_s": round(hf, 3),
        "zaya_jax_tokens_per_s": round(tokens / zaya, 1), "hf_torch_tokens_per_s": round(tokens / hf, 1),
        "speedup_vs_hf": round(hf / zaya, 2), "by_request_type": rows,
        "max_abs_difference": {kind: r["max_abs_difference"] for kind, r in rows.items()},
        "zaya_jax_devices": ours.devices, "moe_backend": resolve_moe_backend(ours.model.config.moe_backend),
        "torch_threads": torch.get_num_threads(), "platform": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_average": {"start": [round(x, 2) for x in load_at_start],
                         "end": [round(x, 2) for x in os.getloadavg()]},
    }, "harness_speed_cpu.json")


def measure(ours, theirs, kind: str, requests: list, repeats: int) -> dict:
    """Both backends on `requests` of one type, timed alternately after a warm-up call each."""
    scores = {}

    def timed(name, lm):
        def run():
            scores[name] = serve(lm, kind, requests)
        return run

    ours.tokens_scored = 0
    timed("zaya_jax", ours)()  # one pass to count the tokens (the same for both sides)
    tokens = ours.tokens_scored
    zaya_s, hf_s = alternate_times(timed("zaya_jax", ours), timed("hf", theirs), repeats)
    zaya, hf = statistics.median(zaya_s), statistics.median(hf_s)
    return {"tokens_scored": tokens, "zaya_jax_s": round(zaya, 3), "hf_torch_s": round(hf, 3),
            "zaya_jax_tokens_per_s": round(tokens / zaya, 1), "hf_torch_tokens_per_s": round(tokens / hf, 1),
            "speedup_vs_hf": round(hf / zaya, 2),
            "max_abs_difference": float(np.max(np.abs(np.subtract(scores["zaya_jax"], scores["hf"])))),
            "times_s": {"zaya_jax": [round(t, 3) for t in zaya_s], "hf_torch": [round(t, 3) for t in hf_s]}}


if __name__ == "__main__":
    main()

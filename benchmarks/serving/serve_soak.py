"""A bounded soak of `python -m zaya_jax.serve`: minutes of random load with disconnects, then
the server must hold no request, no slot and its prefix cache within budget, with flat memory.
Prints JSON.

  python -m benchmarks.serving.serve_soak [--minutes 2] [--clients 6] [--seed 0]

The server runs as a process on port 0 (a tiny random model saved as a checkpoint with a BPE
tokenizer, 4 slots, a 64 KiB prefix cache so that it evicts). Each client thread loops until the
time is up: a random request (completion or chat, streamed or not, greedy or seeded sampling,
prompts sharing prefixes or not, 1 to 60 new tokens), and one stream in five dropped after its
first chunk. The server's resident memory (VmRSS) is read every 5 s; "flat" compares the mean of
the last third of the samples with the mean of the second third. At the end /metrics must read
0 waiting, 0 running, 0 slots in use, prefix cache bytes within its budget, and no compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import REPO  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

from benchmarks.common import stack  # noqa: E402

PREFIX_BUDGET_MB = 0.0625
WORDS = "the quick brown fox jumps over the lazy dog to be or not to be that is the question".split()


def write_checkpoint(root: str) -> str:
    """A tiny random model's checkpoint whose config names its tokenizer -> its directory."""
    import dataclasses
    from tests.harness_fixtures import TEXTS, TINY_LM
    from zaya_jax.data.tokenizer import train_bpe
    from zaya_jax.model.build import create_model
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    model = dataclasses.replace(TINY_LM, max_position_embeddings=256)
    tokenizer = train_bpe(TEXTS, os.path.join(root, "tokenizer.json"), vocab_size=300)
    params, biases = ModelParts.arrays(create_model(model, seed=0))
    save_model(os.path.join(root, "soak"), params, biases, {"model": dataclasses.asdict(model),
                                                            "data": {"tokenizer": tokenizer}})
    return os.path.join(root, "soak")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(zaya_\S+) (\S+)$", text, re.M)}


def client_loop(base: str, seed: int, until: float, counts: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    shared = " ".join(rng.choices(WORDS, k=40))
    while time.monotonic() < until:
        text = (shared if rng.random() < 0.5 else "") + " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
        ask = dict(model="soak", max_tokens=rng.randint(1, 60), temperature=rng.choice([0.0, 0.8]),
                   seed=rng.randint(0, 1000))
        chat, stream = rng.random() < 0.5, rng.random() < 0.5
        outcome = "served"
        try:
            if stream and rng.random() < 0.2:
                body = {**ask, "stream": True, **({"messages": [{"role": "user", "content": text}]} if chat
                                                  else {"prompt": text})}
                with httpx.stream("POST", f"{base}/{'chat/completions' if chat else 'completions'}", json=body,
                                  timeout=120) as answer:
                    next(answer.iter_lines())
                outcome = "dropped"
            elif chat:
                answer = client.chat.completions.create(messages=[{"role": "user", "content": text}], stream=stream, **ask)
                list(answer) if stream else answer.choices[0].message.content
            else:
                answer = client.completions.create(prompt=text, stream=stream, **ask)
                list(answer) if stream else answer.choices[0].text
        except openai.RateLimitError:
            outcome = "429"
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        checkpoint = write_checkpoint(root)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
        proc = subprocess.Popen([sys.executable, "-m", "zaya_jax.serve", "--checkpoint", checkpoint, "--port", "0",
                                 "--slots", "4", "--chunk", "16", "--max_waiting", "8", "--prefix_cache_mb",
                                 str(PREFIX_BUDGET_MB), "--chat_template",
                                 os.path.join(REPO, "zaya_jax/data/chat_templates/plain.jinja")],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            base = re.match(r"serving (\S+) ", proc.stdout.readline()).group(1)
            start, load_start = time.monotonic(), os.getloadavg()[0]
            until = start + 60 * args.minutes
            counts, lock = {}, threading.Lock()
            clients = [threading.Thread(target=client_loop, args=(base, args.seed * 1000 + i, until, counts, lock))
                       for i in range(args.clients)]
            for c in clients:
                c.start()
            samples = []
            while any(c.is_alive() for c in clients):
                samples.append(round(rss_mb(proc.pid), 1))
                time.sleep(5)
            for c in clients:
                c.join()
            time.sleep(0.5)
            final = metrics(base)
            samples.append(round(rss_mb(proc.pid), 1))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    third = max(len(samples) // 3, 1)
    middle, last = samples[third:2 * third] or samples[:1], samples[-third:]
    growth = (sum(last) / len(last)) / (sum(middle) / len(middle)) - 1
    leaks = {"waiting": final["zaya_requests_waiting"], "running": final["zaya_requests_running"],
             "slots_in_use": final["zaya_slots_in_use"]}
    result = {
        "stack": stack(), "minutes": args.minutes, "clients": args.clients, "seed": args.seed,
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "requests": counts, "aborted": final['zaya_requests_total{finish_reason="abort"}'],
        "generated_tokens": final["zaya_engine_generated_tokens_total"],
        "prefix_cache": {"hits": final["zaya_prefix_cache_hits_total"],
                         "evictions": final["zaya_prefix_cache_evictions_total"],
                         "bytes": final["zaya_prefix_cache_bytes"], "budget_bytes": PREFIX_BUDGET_MB * 2 ** 20},
        "compilations": final["zaya_compilations_total"], "held_at_end": leaks,
        "rss_mb_every_5s": samples, "rss_growth_last_vs_middle_third": round(growth, 4),
    }
    result["clean"] = (not any(leaks.values()) and result["compilations"] == 0
                       and final["zaya_prefix_cache_bytes"] <= PREFIX_BUDGET_MB * 2 ** 20 and abs(growth) < 0.05)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

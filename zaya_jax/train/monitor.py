"""Where training metrics go (process 0 only): metrics.jsonl, TensorBoard, tqdm, a PNG heatmap.

  DIR/metrics.jsonl         one JSON object per logged step ({"kind": "train", "step", "loss",
                            "tokens_per_sec", "mfu", "lr", "grad_norm", "router_entropy",
                            "expert_load_min", "expert_load_max", "drop_rate", "skip_rate",
                            "skipped_steps", "expert_load": [L][E+1], ...}) and per evaluation
                            ({"kind": "eval", "step", "eval/<source>/loss", ".../perplexity"}) and per
                            warning ({"kind": "warning", "step", "message"}: a GRPO generation whose
                            groups all had equal rewards)
  DIR/tensorboard/          event files (tensorboardX): every scalar above
  DIR/expert_load.png       expert load per layer over training (rows: layer x expert slot,
                            columns: logged steps), redrawn from metrics.jsonl, so it survives
                            restarts
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
HEATMAP_FILE = "expert_load.png"


def summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without PyTorch where torch is installed but not yet
    imported: tensorboardX.writer imports torch only to accept torch tensors (this monitor writes
    Python floats), and torch is the largest import of a run's start-up.
    While tensorboardX is imported, `import torch` raises ImportError, which it catches; a later
    import of torch is not affected."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:  # nothing left to keep out
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # an import of a None entry raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class Monitor:
    def __init__(self, workdir: str, total_steps: int, *, progress_bar: bool, tensorboard: bool,
                 enabled: bool = True):
        self.workdir, self.enabled = workdir, enabled
        self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            self._tb = summary_writer_class()(os.path.join(workdir, "tensorboard"))
        self._bar = None  # drawn from advance() on, once start-up is over (its messages keep their own lines)
        self._bar_total = total_steps if enabled and progress_bar else None

    def write(self, record: dict[str, Any]) -> None:
        """Appends one record (needs 'step' and 'kind') to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key if "/" in key else f"{record['kind']}/{key}", value, record["step"])
            self._tb.flush()

    def advance(self, step: int) -> None:
        """Draws the progress bar from `step` (the start, or the step restored): its rate counts only this
        session's steps."""
        if self._bar_total is not None and self._bar is None:
            from tqdm import tqdm
            # smoothing 0: the rate is the steps since restart_clock over the time since, not an average
            # that the compile's first sample dominates
            self._bar = tqdm(total=self._bar_total, initial=step, unit="step", dynamic_ncols=True, smoothing=0)

    def restart_clock(self, step: int) -> None:
        """After the session's first step, which compiled the program: the bar's rate and ETA count the
        steps from `step` on (a 40-minute ETA right after a 30 s compile, for a 7-minute run, otherwise)."""
        if self._bar is not None:
            self._bar.start_t = self._bar.last_print_t = time.time()
            self._bar.initial = self._bar.last_print_n = self._bar.n = step

    def progress(self, step: int, loss: float, tokens_per_sec: float, mfu: float | None) -> None:
        if self._bar is None:
            return
        self._bar.n = step
        postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_sec:,.0f}"}
        if mfu is not None:
            postfix["mfu"] = f"{100 * mfu:.1f}%"
        self._bar.set_postfix(postfix, refresh=True)

    def log(self, message: str) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.write(message)
            else:
                print(message, flush=True)

    def draw_heatmap(self) -> None:
        if self.enabled:
            draw_heatmap(os.path.join(self.workdir, METRICS_FILE), os.path.join(self.workdir, HEATMAP_FILE))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_metrics(path: str, kind: str = "train") -> list[dict]:
    """Records of `kind`; when a restarted run logged a step again, the last record of each step wins."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == kind:
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def draw_heatmap(metrics_path: str, png_path: str) -> None:
    """Expert load fractions [logged steps] x [layer, expert slot] as one image."""
    records = [r for r in read_metrics(metrics_path) if "expert_load" in r] if os.path.exists(metrics_path) else []
    if not records:
        return
    from matplotlib.figure import Figure  # not pyplot: no global backend switch (safe inside a notebook)

    load = np.asarray([r["expert_load"] for r in records])  # [T, L, E+1]
    steps = [r["step"] for r in records]
    t, layers, slots = load.shape
    image = load.transpose(1, 2, 0).reshape(layers * slots, t)
    fig = Figure(figsize=(min(16, 8 + t / 40), min(24, 2 + layers * slots / 8)))
    ax = fig.subplots()
    mesh = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                     vmax=max(float(image.max()), 2.0 / (slots - 1)),
                     extent=(steps[0] - 0.5, steps[-1] + 0.5, layers * slots - 0.5, -0.5))
    for layer in range(1, layers):
        ax.axhline(layer * slots - 0.5, color="white", linewidth=0.8)
    ax.set_yticks([layer * slots + slots / 2 - 0.5 for layer in range(layers)])
    ax.set_yticklabels([f"layer {layer}" for layer in range(layers)])
    ax.set_xlabel("step")
    ax.set_title(f"expert load per layer: rows are experts 0..{slots - 2}, then the skip slot "
                 f"(balanced: {1 / (slots - 1):.3f} each)", fontsize=10)
    fig.colorbar(mesh, ax=ax, label="fraction of the layer's tokens")
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, png_path)

"""`ZayaHarnessLM`: an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`) backed by zaya_jax.

    from lm_eval import simple_evaluate
    from zaya_jax.harness import ZayaHarnessLM
    lm = ZayaHarnessLM(checkpoint="runs/demo")          # or hf="DIR"; step=N; batch_size=16
    simple_evaluate(model=lm, tasks=["zaya_demo"], task_manager=...)

It serves the three request types as the harness's own `hf` backend does with the same export
(lm_eval/models/huggingface.py), so scores compare one to one:
  loglikelihood          (context, continuation) -> (sum of the continuation's log-probs, whether
                         every continuation token is the argmax); the text is encoded whole and
                         split as TemplateLM._encode_pair does; an empty context gets bos
  loglikelihood_rolling  a document's log-likelihood over disjoint windows of max_length tokens
                         (lm_eval.utils.get_rolling_token_windows, one token of context)
  generate_until         greedy or sampled (do_sample / temperature / top_k / top_p) continuations
                         of max_gen_toks tokens, cut at eos and at the first stop sequence
Encoding is the export's: `tokenizers` with bos put first (convert.hf_tokenizer.with_bos_first,
what `convert to_hf` writes), not added to a string that starts with bos (a chat-templated one).

Scoring is batched by length (longest first) into [batch_size, W] right-padded rows, W rounded up
to PROMPT_BUCKET so lengths share compiled programs, and only the positions a request scores go
through the output head (continuation_scores); causal attention, causal convolutions and a
dropless MoE backend (a `capacity` config is switched to `auto`) make a row's scores independent
of the padding after it and of the other rows. The batch, scored or generated, is data parallel
over this process's local devices (a `data` mesh; weights replicated; zaya_jax.infer.static_loop's
`mesh`).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (Collator, handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
                                  postprocess_generated_text)

from zaya_jax.errors import UserError
from zaya_jax.infer.static_loop import PROMPT_BUCKET, generate_static

log = logging.getLogger(__name__)
SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p")  # what generate_until passes to generate_static


@functools.partial(jax.jit, static_argnums=0)
def continuation_scores(graphdef, params, ids: jax.Array, scored: jax.Array, counts: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """ids: int32 [B, W+1] right-padded rows; scored: int32 [B, K] the input positions whose next
    token is scored (its first counts[b] entries real, the rest repeats); counts: int32 [B]
    -> (log p(next token) float32 [B, K], 0 past counts[b]; every scored next token is the argmax
    bool [B]). The caller sums the log-probs in float64: a rolling window's ~1000 terms summed in
    float32 are off by up to ~1e-3 (the sum's own rounding), more than the per-token error.

    Only the K scored positions go through the output head and the softmax (a multiple-choice
    request scores a few tokens after a long context)."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model.hidden_states(ids[:, :-1])
    picked = jnp.take_along_axis(hidden, scored[..., None], axis=1)  # [B, K, D]
    logits = model.logits(picked)  # [B, K, V]
    targets = jnp.take_along_axis(ids, scored + 1, axis=1)  # [B, K]
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    real = jnp.arange(scored.shape[1]) < counts[:, None]
    hits = jnp.argmax(logits, axis=-1) == targets
    return jnp.where(real, chosen, 0.0), jnp.all(hits | ~real, axis=1)


def bucket(n: int) -> int:
    return -(-n // PROMPT_BUCKET) * PROMPT_BUCKET


@register_model("zaya_jax")
class ZayaHarnessLM(TemplateLM):
    """A zaya_jax model in the harness: `checkpoint` (a training WORKDIR, its checkpoints/ or a
    `convert to_orbax` output; `step`, default the latest) or `hf` (an HF export directory).

    tokenizer: a tokenizer.json (default: the run's, or DIR/tokenizer.json); chat_template: a .jinja
    or tokenizer_config.json (default: the run's recorded one, or DIR/tokenizer_config.json's);
    batch_size: rows scored together (rounded up to a multiple of the local device count);
    max_length: the context window (default max_position_embeddings); max_gen_toks: the default cap
    of generate_until; seed: the sampling seed; dtype / quantize / mxfp4_block_axis: as zaya_jax.generate's flags;
    model: a ZayaLM in memory instead of checkpoint / hf (the trainer's, zaya_jax.harness.in_training),
    with `tokenizer` given; slots: None, generate_until in static batches of batch_size (every row
    decodes until the batch's last stops at eos or max_gen_toks); N, through the serving engine's N
    rows (rounded up to a multiple of the local device count), each request ending at eos, its
    first stop sequence or max_gen_toks and its row taking the next request (greedy texts equal the
    static batches'; a sampled request draws with its own seed, whatever else runs beside it).
    """

    def __init__(self, checkpoint: str | None = None, hf: str | None = None, step: int | None = None,
                 tokenizer: str | None = None, chat_template: str | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 dtype: str | None = None, quantize: str | None = None, model=None, slots: int | str | None = None,
                 mxfp4_block_axis: str | None = None, **ignored):
        super().__init__()
        from zaya_jax.harness.loading import load_model, load_tokenizer
        if ignored:  # what lm_eval's CLI may add (device, ...) that a JAX model has no use for
            log.info("zaya_jax harness model: ignoring %s", sorted(ignored))
        self.source = {"checkpoint": checkpoint, "hf": hf, "step": step}
        if model is not None and (checkpoint is not None or hf is not None or tokenizer is None):
            raise ValueError("model= (a ZayaLM in memory, e.g. the trainer's) goes with tokenizer= and no "
                             "checkpoint or hf")
        self.model = model or load_model(checkpoint, hf, None if step is None else int(step), dtype, quantize,
                                         mxfp4_block_axis)
        cfg = self.model.config
        self.tokenizer, self.tokenizer_path = load_tokenizer(checkpoint, hf, step, tokenizer, cfg)
        self.template_override = chat_template
        self._template = None
        self.bos_text = self.tokenizer.id_to_token(cfg.bos_token_id)
        self._max_length = int(max_length or cfg.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        from zaya_jax.parallel.mesh import make_mesh
        self.mesh = make_mesh({"data": -1}, jax.local_devices())
        self.devices = self.mesh.devices.size
        def per_device(rows) -> int:  # rounded up to a multiple of the device count
            return -(-int(rows) // self.devices) * self.devices
        self.batch_size = per_device(1 if batch_size == "auto" else batch_size)
        if slots is not None and (not str(slots).isdigit() or int(slots) < 1):
            raise UserError(f"slots={slots!r}: give a positive number of engine rows (slots=8), or leave it out "
                            "for static batches")
        self.slots = None if slots is None else per_device(slots)
        graphdef, params = nnx.split(self.model)
        self.graphdef = graphdef
        self.params = jax.device_put(params, jax.sharding.NamedSharding(self.mesh, jax.P()))
        self.replicated_model = nnx.merge(graphdef, self.params)  # what generation runs, weights on every device
        self.rows_sharding = jax.sharding.NamedSharding(self.mesh, jax.P("data", None))
        self.count_sharding = jax.sharding.NamedSharding(self.mesh, jax.P("data"))
        self.tokens_scored = 0  # real (unpadded) positions scored, for throughput reports

    # ---- what the harness asks of every model
    @property
    def eot_token_id(self) -> int:
        return self.model.config.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.model.config.bos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """Token ids of `string`, bos first unless asked not to or it already starts with bos."""
        if add_special_tokens is None:
            add_special_tokens = not has_bos_prefix(string, self.bos_text)
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- scoring
    def score_rows(self, rows: list[list[int]], counts: list[int]) -> list[tuple[float, bool]]:
        """rows: token-id lists; counts: how many of each row's last tokens are scored -> (their summed
        log-probability given the tokens before, whether each is the argmax), one per row."""
        width = bucket(max(len(r) for r in rows) - 1)
        scored_width = bucket(max(counts))
        ids = np.full((self.batch_size, width + 1), self.model.config.pad_token_id, np.int32)
        scored = np.zeros((self.batch_size, scored_width), np.int32)
        n = np.zeros(self.batch_size, np.int32)
        for i, (row, count) in enumerate(zip(rows, counts, strict=True)):
            ids[i, :len(row)] = row
            positions = np.arange(len(row) - 1 - count, len(row) - 1)
            scored[i] = np.pad(positions, (0, scored_width - count), mode="edge")
            n[i] = count
        with jax.set_mesh(self.mesh):  # filler rows (all pad) score nothing
            placed = [jax.device_put(x, self.rows_sharding if x.ndim == 2 else self.count_sharding)
                      for x in (ids, scored, n)]
            logprobs, greedy = continuation_scores(self.graphdef, self.params, *placed)
        self.tokens_scored += sum(len(r) - 1 for r in rows)
        sums = np.asarray(logprobs, np.float64)[:len(rows)].sum(axis=1)
        return [(float(s), bool(g)) for s, g in zip(sums, np.asarray(greedy)[:len(rows)])]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (log-prob, greedy)."""
        def longest_first(req):
            tokens = req[1] + req[2]
            return -len(tokens), tuple(tokens)

        ordered = Collator(requests, sort_fn=longest_first)
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            rows = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in chunk]
            for (request, _, _), answer in zip(chunk, self.score_rows(rows, [len(c) for _, _, c in chunk]),
                                               strict=True):
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                results.append(answer)
        return ordered.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        ordered = Collator([req.args for req in requests], sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
                           group_by="gen_kwargs", group_fn=lambda req: req[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []  # with slots, each gen_kwargs group is one batch: the engine's rows take it in turn
        for number, chunk in enumerate(ordered.get_batched(n=0 if self.slots else self.batch_size)):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise UserError(f"max_gen_toks {max_gen_toks}: leaves no room for a prompt in max_length "
                                f"{self.max_length}; ask for fewer (gen_kwargs max_gen_toks=...)")
            sampling = self.sampling(kwargs)
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_gen_toks) for c in contexts]
            if self.slots:
                new = self.generate_in_slots(prompts, max_gen_toks, until, self.seed + number, sampling)
            else:
                prompts += [prompts[-1]] * (self.batch_size - len(prompts))  # one compiled loop per prompt width
                new = generate_static(self.replicated_model, prompts, max_gen_toks, seed=self.seed + number,
                                      mesh=self.mesh, **sampling)
            for context, row in zip(contexts, new, strict=False):
                text = postprocess_generated_text(self.tok_decode(row.tolist()), until, None)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                results.append(text)
        return ordered.get_original(results)

    def generate_in_slots(self, prompts: list[list[int]], max_gen_toks: int, until: list[str], seed: int,
                          sampling: dict) -> np.ndarray:
        """prompts through an engine of `slots` rows (zaya_jax.engine.batch), each ending at eos,
        max_gen_toks or once its text holds a stop sequence of `until` (the server's stop-string
        predicate, serve.text.ResponseText, one per request: it keeps its response's last decode)
        -> int32 [B, max_gen_toks], pad after each row's end. Request i samples with seed
        row_seed(seed, i)."""
        from zaya_jax.engine.batch import batch_engine, row_seed, run_to_end
        from zaya_jax.engine.params import SamplingParams
        from zaya_jax.serve.text import ResponseText
        engine = batch_engine(self.model, self.slots, max(map(len, prompts)), max_gen_toks,
                              mesh=self.mesh if self.devices > 1 else None)
        params = [SamplingParams(max_tokens=max_gen_toks, seed=row_seed(seed, i),
                                 stop=ResponseText(self.tokenizer, until).stop_matched, **sampling)
                  for i in range(len(prompts))]
        return run_to_end(engine, prompts, params)[0]

    @staticmethod
    def sampling(kwargs: dict) -> dict:
        """normalize_gen_kwargs' output -> generate_static's temperature / top_k / top_p (greedy
        unless do_sample; do_sample at temperature 0 samples at 1, transformers' default)."""
        unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
        if unknown:
            raise UserError(f"generation kwargs {unknown}: the zaya_jax model supports {', '.join(SAMPLING_KWARGS)} "
                            "(and until, max_gen_toks); drop them from the task's generation_kwargs or --gen_kwargs")
        if not kwargs.get("do_sample"):
            return {"temperature": 0.0}
        top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
        return {"temperature": float(kwargs.get("temperature") or 1.0),
                "top_k": None if top_k is None else int(top_k), "top_p": None if top_p is None else float(top_p)}

    # ---- chat
    def template(self):
        """The chat template as transformers runs it (bos first when it renders none), bos/eos spelled as
        the tokenizer's tokens; loaded on first use (UserError naming the fix when there is none)."""
        if self._template is None:
            from zaya_jax.data.chat_template import ChatTemplate
            from zaya_jax.infer.chat import chat_template_for
            if self.template_override is None and self.source["checkpoint"] is self.source["hf"] is None:
                raise UserError("apply_chat_template: a model given in memory has no recorded chat template; "
                                "pass chat_template=FILE (a .jinja or a tokenizer_config.json)")
            found = chat_template_for(checkpoint=self.source["checkpoint"], hf=self.source["hf"],
                                      override=self.template_override)
            cfg = self.model.config
            self._template = ChatTemplate(found.transformers_source(), found.path, self.bos_text,
                                          self.tokenizer.id_to_token(cfg.eos_token_id))
        return self._template

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template().source if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered as text; without the generation prompt, the last message is left
        open (transformers' continue_final_message: the text ends where its content does)."""
        text = self.template().render(chat_history, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt:
            return text
        final = chat_history[-1]["content"].strip()
        return text[:text.rindex(final) + len(final)]

    def get_model_info(self) -> dict:
        return {"zaya_jax": {k: v for k, v in self.source.items() if v is not None},
                "tokenizer": os.fspath(self.tokenizer_path), "devices": self.devices}

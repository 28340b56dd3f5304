"""CLI: serve a ZAYA model over an OpenAI-compatible HTTP API, with continuous batching.

  python -m zaya_jax.serve --checkpoint runs/demo [--port 8000] [--api_key KEY]
  python -m zaya_jax.serve --hf DIR [--host 0.0.0.0] [--quantize int8|int4] [--slots 8]
  python -m zaya_jax.serve --checkpoint runs/demo --mesh tensor=2,expert=4

Then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY or "none")`,
`client.completions.create(model=NAME, prompt=...)`, `client.chat.completions.create(model=NAME,
messages=[...])`, streaming or not; GET /metrics for Prometheus, /health for a load balancer.

A vision-language model (--checkpoint of a vision-language run, configs/demo_vl.py, or --hf of a
zaya1_vl directory) also reads chat messages' image_url parts (base64 data: URLs only), resized by
the processor its config records; each request with images is prefilled whole and alone
(docs/serving.md); --warm_up_images HxW,... compiles its prefill for those image sizes before the
server listens (the others compile on first use).
The model is served under --served_model_name (default: the checkpoint or HF directory's name).
Its tokenizer is the one the checkpoint carries (--hf: DIR/tokenizer.json), its chat template
the one its run recorded (--hf: DIR/tokenizer_config.json's; --chat_template FILE otherwise),
its context --max_model_len tokens of each slot's decode state (default: the model's
max_position_embeddings, at most 4096). The engine (zaya_jax.engine) holds --slots requests at
once, prefills prompts --chunk tokens per slot and step between decode steps (at most
--prefill_budget tokens a step over all slots), and keeps shared prompt
prefixes in a prefix cache of --prefix_cache_mb MiB (0: off). On one device unless --mesh (the trainer's
axes and sharding rules: zaya_jax.engine.placement) shards the weights and slots over all devices,
a vision-language model's tower too; the devices it uses go to stderr. It compiles before the server
listens; then the line
  READY_LINE
on stdout says it is ready (with --port 0, the port the system chose). Listens on 127.0.0.1
unless --host says otherwise. A request body of more than --max_request_bytes is answered 413.
SIGTERM or Ctrl-C: the server stops accepting connections, finishes the requests in flight within
--shutdown_grace_s seconds (cancelling what is left then) and exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from absl import app, flags

from zaya_jax import cli
from zaya_jax.errors import UserError
from zaya_jax.checkpoints.hf_quantized import BLOCK_AXES, BLOCK_AXIS_HELP
from zaya_jax.checkpoints.quantize import MODES
from zaya_jax.serve.app import READY_LINE, create_app

__doc__ = __doc__.replace("READY_LINE", READY_LINE.format(host="HOST", port="PORT", name="NAME", slots="N",
                                                          context="T"))

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Training run WORKDIR, its checkpoints/ directory, or a "
                                                      "`convert to_orbax` output.")
_HF = flags.DEFINE_string("hf", None, "HF ZAYA checkpoint directory (config.json + safetensors).")
_STEP = flags.DEFINE_integer("step", None, "With --checkpoint: the step to serve (default: the newest).", lower_bound=0)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (default: the checkpoint's, or DIR/tokenizer.json).")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "Chat template (.jinja or tokenizer_config.json) "
                                                            "for /v1/chat/completions (default: the run's).")
_NAME = flags.DEFINE_string("served_model_name", None, "The model's name in the API (default: the directory name).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, printed).", lower_bound=0,
                             upper_bound=65535)
_API_KEY = flags.DEFINE_string("api_key", None, "Require `Authorization: Bearer KEY` on /v1 routes (401 without).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype (default: the checkpoint's; "
                                                                   "float32 for --hf).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, sorted(MODES), "Weight-only quantization.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 64, "Quantization group along the input axis.", lower_bound=1)
_MXFP4_BLOCK_AXIS = flags.DEFINE_enum("mxfp4_block_axis", None, list(BLOCK_AXES), BLOCK_AXIS_HELP)
_SLOTS = flags.DEFINE_integer("slots", 8, "Requests decoded at once.", lower_bound=1)
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None, "Tokens per request, prompt and output (default: "
                                                             "max_position_embeddings, at most 4096).", lower_bound=2)
_CHUNK = flags.DEFINE_integer("chunk", 32, "Prompt tokens prefilled per slot and engine step (and the prefix "
                                           "cache's block).", lower_bound=1)
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_budget", None, "Prompt tokens prefilled per engine step, all "
                                       "slots together, the earliest request first (default: --chunk per "
                                       "prefilling slot).", lower_bound=1)
_PREFIX_CACHE_MB = flags.DEFINE_float("prefix_cache_mb", 256.0, "Prefix cache budget in MiB (0: off).", lower_bound=0)
_MAX_WAITING = flags.DEFINE_integer("max_waiting", 64, "Sequences queued for a slot (a request's n choices each) "
                                   "before 429.", lower_bound=1)
_MAX_TOP_LOGPROBS = flags.DEFINE_integer("max_top_logprobs", 20, "The most top_logprobs a request may ask for.",
                                         lower_bound=0)
_MESH = flags.DEFINE_string("mesh", None, "Serve on every device as the trainer's mesh, AXIS=SIZE,... over "
                                         "data, fsdp, expert, tensor, context (e.g. tensor=2,expert=4; one may "
                                         "be -1: the rest). Weights sharded by the trainer's rules, slots over "
                                         "data; a vision-language model's tower too. Default: one device.")
_WARM_UP_IMAGES = flags.DEFINE_list("warm_up_images", [], "Image sizes HxW (e.g. 448x448,224x336) whose image "
                                    "prefill compiles before the server listens (a vision-language model).")
_MAX_REQUEST_BYTES = flags.DEFINE_integer("max_request_bytes", None, "The largest request body in bytes; more is "
                                           "a 413 (default: 64 per context token, at least 1 MiB; for a "
                                           "vision-language model 4 per pixel of an image filling the "
                                           "context, at least 16 MiB).", lower_bound=1)
_GRACE = flags.DEFINE_float("shutdown_grace_s", 30.0, "On SIGTERM, seconds to finish the requests in flight.",
                            lower_bound=0)

DEFAULT_CONTEXT = 4096


def check_flags() -> None:
    if (_HF.value is None) == (_CHECKPOINT.value is None):
        raise app.UsageError("give exactly one of --checkpoint and --hf")
    if _STEP.value is not None and _CHECKPOINT.value is None:
        raise app.UsageError("--step goes with --checkpoint (an HF directory holds one model)")


def load_served():
    """(the model: a ZayaLM or a ZayaVL, the ServedModel: name, tokenizer, chat template, end-of-turn
    ids, and the image processor the model's config records: None for a text model)."""
    from zaya_jax.data.chat_template import end_of_turn_ids
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.infer.chat import chat_template_for
    from zaya_jax.model.vision.vl import text_model
    from zaya_jax.infer.loading import load_model, model_image_processor, tokenizer_for
    from zaya_jax.serve.service import ServedModel
    source = _CHECKPOINT.value or _HF.value
    processor = model_image_processor(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value)
    path, told = tokenizer_for(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value, given=_TOKENIZER.value)
    if told:
        print(told, file=sys.stderr)
    try:
        template = chat_template_for(checkpoint=_CHECKPOINT.value, hf=_HF.value, override=_CHAT_TEMPLATE.value)
    except UserError as err:
        if _CHAT_TEMPLATE.value is not None:
            raise
        print(f"note: /v1/chat/completions is off: {err}", file=sys.stderr)
        template = None
    options = dict(quantize=_QUANTIZE.value, group_size=_GROUP_SIZE.value, mxfp4_block_axis=_MXFP4_BLOCK_AXIS.value)
    if _DTYPE.value is not None:
        options["dtype"] = _DTYPE.value
    model = load_model(checkpoint=_CHECKPOINT.value, hf=_HF.value, step=_STEP.value, **options)
    cfg = text_model(model).config
    tokenizer = Tokenizer(path, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    end_of_turn = end_of_turn_ids(template, tokenizer) if template is not None else []
    name = _NAME.value or os.path.basename(os.path.normpath(source))
    return model, ServedModel(name, tokenizer, template, end_of_turn), processor


def warm_up_image_sizes(processor) -> tuple[tuple[int, int], ...]:
    """--warm_up_images as ((height, width), ...); UserError for a text model (processor None), a
    malformed size or one the model's image processor refuses."""
    if not _WARM_UP_IMAGES.value:
        return ()
    if processor is None:
        raise UserError("--warm_up_images: the model is text only; image sizes are for a vision-language model")
    sizes = []
    for size in _WARM_UP_IMAGES.value:
        height, x, width = size.strip().partition("x")
        if not (x and height.isdigit() and width.isdigit()):
            raise UserError(f"--warm_up_images {size!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448")
        try:
            processor.size(int(height), int(width))
        except UserError as err:
            raise UserError(f"--warm_up_images {size}: {err}") from None
        sizes.append((int(height), int(width)))
    return tuple(sizes)


def context_length(cfg) -> int:
    limit = cfg.max_position_embeddings if cfg.position_limit is not None else None
    if _MAX_MODEL_LEN.value is None:
        return min(limit or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if limit is not None and _MAX_MODEL_LEN.value > limit:
        raise UserError(f"--max_model_len {_MAX_MODEL_LEN.value}: past the model's max_position_embeddings {limit}; "
                        f"give at most {limit}")
    return _MAX_MODEL_LEN.value


def serving_mesh(model):
    """--mesh as a Mesh over every device (None without it), checked against the model and --slots
    before anything compiles."""
    from zaya_jax.engine.placement import check_mesh, mesh_text
    from zaya_jax.parallel.mesh import MESH_FLAG, make_mesh, parse_mesh_flag
    if _MESH.value is None:
        return None
    mesh = make_mesh(parse_mesh_flag(_MESH.value), flag=MESH_FLAG)
    shape = dict(mesh.shape)
    check_mesh(model, shape, _SLOTS.value, f"--mesh {_MESH.value}",
               lambda axis, size: f"--mesh {mesh_text({**shape, axis: size})}")
    return mesh


def say_devices(engine) -> None:
    """The devices the engine's weights and state are on, and its mesh, on stderr."""
    import jax
    from zaya_jax.engine.placement import mesh_text
    devices = engine.devices()
    kinds = ", ".join(sorted({f"{d.platform} {d.device_kind}" for d in devices}))
    layout = (f"mesh {mesh_text(dict(engine.mesh.shape))}" if engine.mesh is not None
              else f"no mesh (--mesh shards over all {jax.device_count()})")
    print(f"serving on {len(devices)} device{'s' if len(devices) > 1 else ''} ({kinds}), {layout}", file=sys.stderr)


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({err.strerror}); pick another port "
                        "(--port 0: any free one)") from None
    sock.listen(2048)
    return sock


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    check_flags()
    import uvicorn
    from zaya_jax.engine.engine import Engine
    from zaya_jax.model.vision.vl import text_model
    from zaya_jax.serve.metrics import ServerMetrics
    from zaya_jax.serve.service import Service
    sock = listening_socket(_HOST.value, _PORT.value)  # a taken port is named before the weights load
    model, served, processor = load_served()
    image_sizes = warm_up_image_sizes(processor)
    mesh = serving_mesh(model)
    engine = Engine(model, slots=_SLOTS.value, cache_size=context_length(text_model(model).config),
                    chunk=_CHUNK.value, prefix_cache_bytes=int(_PREFIX_CACHE_MB.value * 2 ** 20),
                    max_top_logprobs=_MAX_TOP_LOGPROBS.value, image_processor=processor, mesh=mesh,
                    prefill_budget=_PREFILL_BUDGET.value)
    say_devices(engine)
    engine.warm_up(image_sizes=image_sizes)
    metrics = ServerMetrics(engine)
    service = Service(engine, served, max_waiting=_MAX_WAITING.value, metrics=metrics)
    server = uvicorn.Server(uvicorn.Config(create_app(service, _API_KEY.value, _MAX_REQUEST_BYTES.value),
                                           log_level="warning",
                                           timeout_graceful_shutdown=_GRACE.value, lifespan="off"))
    host, port = sock.getsockname()[:2]
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        # uvicorn handles both while it runs and raises them again once stopped: this makes that a no-op
        signal.signal(stop_signal, lambda *_: None)
    engine.start()
    print(READY_LINE.format(host=host, port=port, name=served.name, slots=engine.slots, context=engine.cache_size),
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
    print("server stopped", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main)

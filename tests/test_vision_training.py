"""Training a ZAYA1-VL with zaya_jax.train: a text run's checkpoint gets the tower, merger and vision
LoRA, trained on image_chat rows with the text weights frozen.

One small run is shared (3 steps on a data x fsdp x expert mesh, from a text checkpoint of the fixtures'
text model): its start must be the text checkpoint plus a fresh tower (built here by hand), its
state after training must equal pure one-device train steps from that start, its first loss must
equal the loss computed from ZayaVL's logits in numpy (and change with the images: the tower is
on), the frozen text weights and biases must be bit-identical at the end while the tower and LoRA
moved, and the logged image-token share must be the first batch's.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from tests.test_proof_sharded_training import assert_states_close
from tests.vision_fixtures import IDS, TEXT, VISION
from zaya_jax.config import ConfigError
from zaya_jax.config_files import load_config_file, vision_section
from zaya_jax.data import prepare
from zaya_jax.model.vision.vl import ZayaVL
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.train import balancing
from zaya_jax.checkpoints.orbax_checkpoint import config_json, save_model
from zaya_jax.train.data import open_training_data
from zaya_jax.train.loop import Trainer
from zaya_jax.train.objectives import make_objective
from zaya_jax.train.optimizer import make_optimizer, param_labels, schedule, text_weight
from zaya_jax.train.settings import settings_from_config
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.train.state import initial_state
from zaya_jax.train.step import train_step
from zaya_jax.engine import generate

STEPS, SEQ, BATCH, CAPACITY = 3, 64, 8, 48  # a row: 3 conversations (their 48 patches), 36 of 64 positions
TEXT_ONLY = dataclasses.replace(TEXT, vision_lora_rank_attn=0, vision_lora_rank_mlp=0)
TOKENIZER = {"sha256": "synthetic", "vocab_size": 96, "bos_id": 2, "eos_id": 1, "pad_id": 0}


def _digit_documents(n: int = 48):
    """n conversations (ids, mask, images): 'question' tokens, the image span, the digit's token, eos;
    each image a 16x16 digit (16 patches of 4x4, 4 image tokens)."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    docs = []
    for i in range(n):
        image = np.kron(np.round(digits.images[i] * 255 / 16), np.ones((2, 2))).astype(np.uint8)
        ids = [2, 5, 6, 7, IDS.vision_start, *[IDS.image] * 4, IDS.vision_end, 8, 10 + int(digits.target[i]), 1]
        mask = [0] * (len(ids) - 2) + [1, 1]
        docs.append((np.asarray(ids, np.int32), np.asarray(mask, np.int32), [np.repeat(image[..., None], 3, 2)]))
    return docs


def _text_config():
    config = load_config_file("configs/tiny.py")
    config.model.update({k: v for k, v in dataclasses.asdict(TEXT_ONLY).items() if k in config.model})
    return config


def _vl_config(tmp_path, source: str):
    prepare.write_tokenized(str(tmp_path / "digits"), _digit_documents(), tokenizer_info=TOKENIZER, kind="image_chat")
    config = _text_config()
    config.model.update(vision_lora_rank_attn=TEXT.vision_lora_rank_attn, vision_lora_rank_mlp=TEXT.vision_lora_rank_mlp)
    config.vision = vision_section(**{f.name: getattr(VISION, f.name) for f in dataclasses.fields(VISION)
                                      if f.name != "dtype"},
                                   image_token_id=IDS.image, vision_start_token_id=IDS.vision_start,
                                   vision_end_token_id=IDS.vision_end, min_pixels=256, max_pixels=256)
    config.vision.fullatt_block_indexes = list(VISION.fullatt_block_indexes)
    config.train.update(steps=STEPS, data="pipeline", objective="sft", init_from_checkpoint=source,
                        patch_capacity=CAPACITY, freeze_text=True, log_every_steps=1)
    config.optimizer.update(warmup_steps=0, schedule="constant", learning_rate=1e-2)
    config.checkpoint.update(every_steps=0, async_save=False)
    config.eval.update(every_steps=STEPS, max_batches=1)
    config.mesh.update(data=2, fsdp=2, expert=2)
    config.monitor.update(progress_bar=False, tensorboard=False)
    config.data = ml_collections.ConfigDict(dict(
        sources={"digits": str(tmp_path / "digits")}, tokenizer="unused", pad_id=0, heldout_fraction=0.25,
        packing_bins=4, worker_count=0, worker_buffer_size=1, prefetch_buffer_size=2,
        phases=(dict(name="one", token_budget=BATCH * SEQ * STEPS, seq_len=SEQ, rope_theta=TEXT.rope_theta,
                     global_batch_size=BATCH, weights={"digits": 1.0}),),
        eval=dict(seq_len=SEQ, batch_size=BATCH, max_batches=1)))
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(config, the text model, the run's state at its start and after training, its log records, the
    text checkpoint's and the run's directories)."""
    tmp = tmp_path_factory.mktemp("vl")
    text = ZayaLM(TEXT_ONLY, rngs=nnx.Rngs(7))
    save_model(str(tmp / "text"), *ModelParts.arrays(text), config_json(_text_config()))
    config = _vl_config(tmp, str(tmp / "text"))
    records = []
    trainer = Trainer(config, str(tmp / "run"), on_log=records.append)
    try:
        start = jax.device_get(trainer.state)
        trainer.run()
        end = jax.device_get(trainer.state)
    finally:
        trainer.close()
    return config, text, start, end, records, str(tmp / "text"), str(tmp / "run")


def _hand_made_start(config, text: ZayaLM):
    """A fresh ZayaVL (the run's seed) whose text weights are the text model's but its vision LoRA."""
    s = settings_from_config(config)
    params, biases = ModelParts.arrays(ZayaVL(s.model, VISION, IDS, rngs=nnx.Rngs(s.train.seed)))
    text_params, text_biases = ModelParts.arrays(text)

    def fill(vl, saved):
        return {k: (fill(v, saved[k]) if isinstance(v, dict) else saved[k]) if k in saved else v
                for k, v in vl.items()}
    return {**params, "text": fill(params["text"], text_params)}, text_biases


def _one_device(config, params, biases, steps):
    """(state after `steps` pure train steps on one device, the first step's metrics, the first batch)."""
    s = settings_from_config(config)
    tx = make_optimizer(s.optimizer, s.train.steps, text_weight)
    controller = balancing.make_controller(s.balancing)
    abstract = nnx.eval_shape(lambda: ZayaVL(s.model, VISION, IDS, rngs=nnx.Rngs(0)))
    step = jax.jit(functools.partial(
        train_step, parts=ModelParts(abstract), tx=tx, controller=controller,
        lr_schedule=schedule(s.optimizer, s.train.steps, s.optimizer.learning_rate), microbatches=1,
        loss_chunk=s.train.loss_chunk_size, balance=False, include_skip=False, mesh=None,
        objective=make_objective(s), frozen=text_weight), static_argnames="rope_theta")
    device = jax.devices()[0]
    state = jax.device_put(initial_state(params, biases, tx, controller, s.train.seed), device)
    data = open_training_data(config, s)
    batches = [next(data) for _ in range(steps)]
    data.close()
    first = None
    for batch in batches:
        state, metrics = step(state, jax.device_put(batch, device), rope_theta=TEXT.rope_theta)
        first = first or jax.device_get(metrics)
    return jax.device_get(state), first, batches[0]


def _grad_norms(parts: ModelParts, params, biases, batch) -> tuple[float, float]:
    """(the global norm of the mean loss's gradient over the trained parameters, over all of them)."""
    from zaya_jax.model.vision.vl import ImageBatch
    from zaya_jax.train.optimizer import path_name
    images = ImageBatch(*(jnp.asarray(batch[k]) for k in ("patches", "patch_positions", "image_segments",
                                                          "window_segments")))

    def loss(p):
        model = parts.merge(p, biases)
        logits = model(jnp.asarray(batch["inputs"]), images, segment_ids=jnp.asarray(batch["segment_ids"]))
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], -1)[..., 0]
        return jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])
    grads = jax.grad(loss)(params)
    trained = jax.tree_util.tree_map_with_path(lambda path, g: 0 * g if text_weight(path_name(path)) else g, grads)
    return float(optax.tree.norm(trained)), float(optax.tree.norm(grads))


def _numpy_loss(model: ZayaVL, batch, patches=None) -> float:
    """The masked mean nll of `batch` from ZayaVL's logits (the tower on the batch's patches)."""
    from zaya_jax.model.vision.vl import ImageBatch
    images = ImageBatch(jnp.asarray(batch["patches"] if patches is None else patches),
                        jnp.asarray(batch["patch_positions"]), jnp.asarray(batch["image_segments"]),
                        jnp.asarray(batch["window_segments"]))
    hidden, _ = model.hidden_states(jnp.asarray(batch["inputs"]), images, segment_ids=jnp.asarray(batch["segment_ids"]),
                                    positions=jnp.asarray(batch["positions"]), rope_theta=TEXT.rope_theta)
    logits = np.asarray(model.text.logits(hidden), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return float((nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum())


def _leaves(tree, keep):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if keep(jax.tree_util.keystr(p))}


def test_a_vision_run_starts_from_the_text_checkpoint_and_equals_one_device(run):
    config, text, start, end, records, _, _ = run
    params, biases = _hand_made_start(config, text)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(start.params), jax.tree.leaves(params)):
        name = jax.tree_util.keystr(path)
        if "'text'" in name and "vision_lora" not in name:   # the checkpoint's, exactly
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:                                                 # initialised under jit in the trainer
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8, err_msg=name)
    np.testing.assert_array_equal(start.biases, biases)
    params = start.params
    reference, first, batch = _one_device(config, params, biases, STEPS)
    assert_states_close(end, reference)

    model = ModelParts(nnx.eval_shape(lambda: ZayaVL(TEXT, VISION, IDS, rngs=nnx.Rngs(0)))).merge(params, biases)
    want = _numpy_loss(model, batch)
    np.testing.assert_allclose(first["loss"], want, rtol=1e-5)
    assert abs(_numpy_loss(model, batch, np.zeros_like(batch["patches"])) - want) > 1e-4  # the images count (20x the tolerance above)
    trained_norm, all_norm = _grad_norms(ModelParts(model), params, biases, batch)
    np.testing.assert_allclose(first["grad_norm"], trained_norm, rtol=1e-4)  # the frozen weights' gradient is not in it
    assert all_norm > 1.5 * trained_norm
    train = [r for r in records if r.get("kind") == "train"]
    share = np.sum((batch["inputs"] == IDS.image) & (batch["segment_ids"] > 0)) / np.sum(batch["segment_ids"] > 0)
    assert train[0]["step"] == 1 and train[0]["image_token_share"] == pytest.approx(share, rel=1e-6) and share > 0.2
    assert any("eval/digits/loss" in r for r in records)


def test_freezing_keeps_the_text_model_and_trains_the_tower_and_lora(run):
    _, _, start, end, _, _, _ = run
    frozen = lambda name: "'text'" in name and "vision_lora" not in name  # noqa: E731
    before, after = _leaves(start.params, frozen), _leaves(end.params, frozen)
    assert before and before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    np.testing.assert_array_equal(end.biases, start.biases)
    trained = lambda name: "'vision'" in name or "'o_b'" in name  # noqa: E731
    moved = {n for n, a in _leaves(end.params, trained).items()
             if not np.array_equal(a, _leaves(start.params, trained)[n])}
    assert len(moved) == len(_leaves(start.params, trained)), sorted(set(_leaves(start.params, trained)) - moved)
    moments = sum(np.size(x) for p, x in jax.tree_util.tree_leaves_with_path(end.opt_state)
                  if np.ndim(x) and "ns_coeffs" not in jax.tree_util.keystr(p))  # Muon's 3 constants
    trainable = sum(np.size(x) for x in _leaves(end.params, lambda n: not frozen(n)).values())
    assert moments == 2 * trainable  # AdamW's two moments of the trained parameters: no state for frozen ones


def test_the_text_model_is_grouped_as_in_a_text_run():
    abstract = nnx.eval_shape(lambda: ZayaVL(TEXT, VISION, IDS, rngs=nnx.Rngs(0)))
    params, _ = ModelParts.arrays(abstract)
    s = settings_from_config(load_config_file("configs/tiny.py"))
    labels = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(param_labels(params, s.optimizer))}
    assert labels["['text']['layers']['attention']['q_proj']"] == "muon"
    assert labels["['vision']['merger']['fc1_kernel']"] == "adamw"
    frozen = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_leaves_with_path(param_labels(params, s.optimizer, text_weight))}
    assert frozen["['text']['layers']['attention']['q_proj']"] == "frozen"
    assert frozen["['text']['layers']['attention']['vision_lora']['q_a']"] == "adamw"


@pytest.mark.parametrize("change,message", [
    (dict(train=dict(objective="lm")), "train.objective must be 'sft'"),
    (dict(train=dict(patch_capacity=6)), "train.patch_capacity must be a positive multiple of 4"),
    (dict(mesh=dict(context=2)), "mesh.context must be 1"),
    (dict(vision=None, train=dict(patch_capacity=0)), "train.freeze_text is set but the config has no vision"),
    (dict(vision=None, train=dict(patch_capacity=0, freeze_text=False, augment_scale=0.1)),
     "train.augment_scale is set but the config has no vision"),
    (dict(train=dict(augment_shift=0.5)), r"train.augment_shift must lie in \[0, 0.5\), got 0.5"),
])
def test_a_vision_run_names_what_it_cannot_do(tmp_path, change, message):
    config = _vl_config(tmp_path, "unused")
    if "vision" in change:
        del config["vision"]
    for section in ("train", "mesh"):
        config[section].update(change.get(section, {}))
    with pytest.raises(ConfigError, match=message):
        settings_from_config(config)


def test_a_text_run_refuses_image_chat_data(tmp_path):
    config = _vl_config(tmp_path, "unused")
    del config["vision"]
    config.train.update(patch_capacity=0, freeze_text=False)
    with pytest.raises(ConfigError, match="hold image_chat data .* add a vision section"):
        open_training_data(config, settings_from_config(config))


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """(the run's `convert to_hf` directory, with a word-level tokenizer; what convert said on stderr)."""
    from tests.train_helpers import REPO
    tmp = tmp_path_factory.mktemp("vl_export")
    done = subprocess.run([sys.executable, "-m", "zaya_jax.convert", "to_hf", "--checkpoint", run[-1], "--out",
                           str(tmp / "hf"), "--tokenizer", _word_tokenizer(tmp / "tokenizer.json")], cwd=REPO,
                          check=True, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})  # its flags
    return tmp / "hf", done.stderr


def test_the_run_generates_with_images_exports_and_is_refused_where_it_cannot_go(run, exported, tmp_path, capsys):
    """generate --checkpoint --image resizes as the run's data (min/max pixels 256: 16x16, 4 image tokens)
    and prints what the Python API generates; convert to_hf writes a zaya1_vl directory that loads back to
    the same model, and to_orbax turns it back into the same checkpoint model; evaluate scores its held-out
    rows as the trainer did; a text checkpoint with --image, the run given to preference_pairs (which
    answers text questions), the harness or --quantize, and resuming it with a text config each end in one
    error naming the input."""
    from PIL import Image

    from tests.test_infer_cli import run_main
    from tests.train_helpers import REPO
    from zaya_jax.data.vision.processor import image_processor
    from zaya_jax.checkpoints.hf_vl import load_vl_hf
    from zaya_jax.errors import UserError
    from zaya_jax.evaluation.answering import load_checkpoint as load_for_tasks
    from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model, read_config
    from zaya_jax.data.vision.processor import ImageProcessor
    from zaya_jax.data.vision.prompts import expand_placeholders

    config, _, _, _, _, text_dir, run_dir = run
    image = _digit_documents(1)[0][2][0][:8:, :8]                       # an 8x8 image, resized to 16x16
    Image.fromarray(image).save(tmp_path / "d.png")
    run_main(["--checkpoint", run_dir, "--image", str(tmp_path / "d.png"), "--prompt_ids", f"2,5,{IDS.image},8",
              "--max_new_tokens", "3", "--ignore_eos"])
    printed = capsys.readouterr().out.split()
    model, _ = load_checkpoint_model(run_dir)
    prompt = expand_placeholders([2, 5, IDS.image, 8], [(1, 4, 4)], IDS)
    assert prompt.count(IDS.image) == 4
    processor = ImageProcessor(4, 2, 1, min_pixels=256, max_pixels=256)
    assert printed == [str(t) for t in generate(model, [prompt], 3, images=[[image]], stop_at_eos=False,
                                                         image_processor=processor)[0]]

    hf_dir, _ = exported
    written = load_vl_hf(hf_dir)
    for a, b in zip(jax.tree.leaves(nnx.state(written, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    assert (hf_dir / "tokenizer.json").is_file()
    subprocess.run([sys.executable, "-m", "zaya_jax.convert", "to_orbax", "--hf", str(hf_dir), "--out",
                    str(tmp_path / "orbax")], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})                            # and back
    back, _ = load_checkpoint_model(str(tmp_path / "orbax"))
    assert isinstance(back, ZayaVL) and back.ids == IDS and back.vision.config == model.vision.config
    assert image_processor(read_config(str(tmp_path / "orbax"))) == processor   # the run's sizes, through the export
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)

    done = subprocess.run([sys.executable, "-m", "zaya_jax.evaluate", "--checkpoint", run_dir], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    (logged,) = [r for r in run[4] if "eval/digits/loss" in r]                 # the trainer's evaluation at step 3
    assert json.loads(done.stdout)["results"]["digits"]["loss"] == pytest.approx(logged["eval/digits/loss"], rel=1e-5)
    with pytest.raises(UserError, match=f"--image: --checkpoint {text_dir} holds a text model"):
        run_main(["--checkpoint", text_dir, "--image", str(tmp_path / "d.png"), "--prompt_ids", "2"])
    with pytest.raises(UserError, match=f"--image: --checkpoint {text_dir} holds a text model"):  # before the template
        run_main(["--checkpoint", text_dir, "--image", str(tmp_path / "d.png"), "--chat", "hi"])
    with pytest.raises(UserError, match="holds a vision-language model: this command answers text questions .*"
                                        f"python -m zaya_jax.evaluate_tasks --checkpoint {run_dir} scores it"):
        load_for_tasks(run_dir, None, str(tmp_path / "tokenizer.json"))
    from zaya_jax.harness.loading import load_model as load_for_harness
    from zaya_jax.infer.loading import load_checkpoint
    with pytest.raises(UserError, match="holds a vision-language model; the harness scores text models .*: python -m "
                                        f"zaya_jax.evaluate_tasks --checkpoint {run_dir}"):
        load_for_harness(run_dir, None, None)
    with pytest.raises(UserError, match="--quantize: .* holds a vision-language model"):
        load_checkpoint(run_dir, quantize="int8")
    text_config = _text_config()
    with pytest.raises(ConfigError, match=re.escape(
            "its checkpoints were written by a vision-language train.objective='sft' run on image_chat data "
            "(data.sources digits), and this config is a train.objective='lm' run on synthetic data: resume it")):
        Trainer(text_config, run_dir)


def test_the_export_answers_held_out_digits_as_the_checkpoint(run, exported, tmp_path, capsys):
    """convert to_hf writes the run's image processor (min/max pixels 256: an 8x8 digit -> 16x16, 4 image
    tokens) as preprocessor_config.json, checked on write: 8 digits the run never saw get the same answers
    and the same log-probability of the right digit through the checkpoint (sized by its config) and through
    its export (sized by what the export says), and generate --hf answers as the checkpoint does."""
    from PIL import Image

    from tests.test_infer_cli import run_main
    from zaya_jax.data.vision.processor import image_processor
    from zaya_jax.checkpoints.hf_vl import load_vl_hf, load_vl_processor
    from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, load_checkpoint_model, read_config
    from zaya_jax.data.vision.prompts import expand_placeholders, prompt_image_batch

    hf_dir, told = exported
    assert "the image processor's grids, image tokens and patches on 3 probe images" in told
    digits = _digit_documents(56)[48:]                           # the run trained on the first 48
    images = [np.ascontiguousarray(image[::2, ::2]) for _, _, (image,) in digits]     # the 8x8 digits
    right = np.asarray([ids[-2] for ids, _, _ in digits])        # the digit's token
    question = [2, 5, 6, 7, IDS.image, 8]

    def scores(model, processor):
        """[8, V] log-probabilities of the answer's first token."""
        prompts = [expand_placeholders(question, [processor.grid(image)], IDS) for image in images]
        assert all(p.count(IDS.image) == 4 for p in prompts), [p.count(IDS.image) for p in prompts]
        batch, _ = prompt_image_batch([[image] for image in images], model, processor)
        logits = nnx.jit(lambda m, x, im: m(x, im))(model, np.asarray(prompts), batch)[:, -1]
        return np.asarray(jax.nn.log_softmax(logits, -1))
    want = scores(load_checkpoint_model(run[-1])[0], image_processor(read_config(checkpoint_dir(run[-1]))))
    got = scores(load_vl_hf(hf_dir), load_vl_processor(hf_dir, report=pytest.fail))
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got[np.arange(8), right], want[np.arange(8), right], rtol=1e-5, atol=1e-6)

    Image.fromarray(images[0]).save(tmp_path / "d.png")
    run_main(["--hf", str(hf_dir), "--image", str(tmp_path / "d.png"), "--prompt_ids", ",".join(map(str, question)),
              "--max_new_tokens", "1", "--ignore_eos"])
    out, err = capsys.readouterr()
    assert out.split() == [str(want[0].argmax())]
    assert f"[image {tmp_path / 'd.png'}: 8x8 -> 16x16 pixels, grid 1 x 4 x 4 patches, 4 image tokens]" in err


def _word_tokenizer(path) -> str:
    """A tokenizer.json of the run's 96 ids (words w3..w95; other words are <pad>) -> its path."""
    import tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, 96)}}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>")).save(str(path))
    return str(path)


def test_evaluate_tasks_scores_the_run_on_plain_shifted_and_rescaled_digits(run, tmp_path):
    """`python -m zaya_jax.evaluate_tasks --checkpoint RUN` of a VL run: the 359 held-out digits, as they
    are, moved by one pixel and by two along each axis, drawn at 6 or 10 of 8 pixels and at 6 of 8, and at
    60% contrast, with their images resized as the run's config says (16x16: 4 image tokens),
    answer for answer what the model generates for prompts and images made here with the processor
    written out by hand; and the variants are other images (other answers)."""
    from tests.train_helpers import REPO
    from zaya_jax.data.chat_template import PLAIN, ChatTemplate
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.checkpoints.orbax_checkpoint import load_checkpoint_model
    from zaya_jax.data.vision.demo_images import digit_conversations, digit_variant
    from zaya_jax.evaluation.digit_accuracy import digit_accuracy
    from zaya_jax.data.vision.processor import ImageProcessor

    run_dir = run[-1]
    tokenizer = _word_tokenizer(tmp_path / "tokenizer.json")
    done = subprocess.run([sys.executable, "-m", "zaya_jax.evaluate_tasks", "--checkpoint", run_dir, "--tokenizer",
                           tokenizer, "--batch_size", "359", "--max_new_tokens", "2"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    scored = json.loads(done.stdout)
    assert scored["questions"] == 359 and list(scored["accuracy_by_variant"]) == [
        "plain", "shifted", "rescaled", "shifted_2px_diagonal", "rescaled_6px", "contrast_60"]
    assert scored["accuracy"] == scored["accuracy_by_variant"]["plain"]
    model, _ = load_checkpoint_model(run_dir)
    processor = ImageProcessor(4, 2, 1, min_pixels=256, max_pixels=256)
    heldout = digit_conversations("heldout")
    for variant in ("plain", "shifted", "shifted_2px_diagonal", "contrast_60"):
        want = digit_accuracy(model, Tokenizer(tokenizer, bos_id=2, eos_id=1, pad_id=0), processor,
                              digit_variant(heldout, variant), ChatTemplate.load(PLAIN), max_new_tokens=2,
                              batch_size=359)
        got = scored["variants"][variant]
        assert (got["correct"], got["answers"]) == (want["correct"], [list(a) for a in want["answers"]])
        assert got["accuracy"] == round(got["correct"].count("1") / 359, 4)
    for variant in ("shifted", "rescaled", "shifted_2px_diagonal", "rescaled_6px", "contrast_60"):
        assert scored["variants"][variant]["answers"] != scored["variants"]["plain"]["answers"], variant


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_the_vision_step_lowers_for_gpus(tmp_path, platform):
    """The VL train step, lowered for CUDA and ROCm from abstract shapes (data x fsdp; the Pallas
    grouped matmul, forward and both gradients, inside the shard_map; attention XLA's, the only
    one that attends image tokens both ways), takes the image arrays and runs the tower on them."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    from pallas_kernels import lower_for_gpu
    from tests.test_gpu_lowering import ATTENTION_KERNELS, GMM_KERNELS, triton_calls
    from zaya_jax.parallel.mesh import make_mesh
    from zaya_jax.train.program import abstract_batch, build_program, image_shape
    from zaya_jax.parallel.rules import with_shardings

    config = _vl_config(tmp_path, "unused")
    config.model.update(moe_backend="auto")
    config.mesh.update(data=4, fsdp=2, expert=1)
    s = settings_from_config(config)
    mesh = make_mesh(s.mesh.sizes)
    program = build_program(s, mesh)
    state = with_shardings(program.abstract_state, program.shardings)
    batch = abstract_batch(BATCH, SEQ, image_shape(s))
    text = lower_for_gpu(platform, program.train_step, state, batch, s.model.rope_theta, mesh=mesh).as_text()
    calls = triton_calls(ir.Module.parse(text, context=jax_mlir.make_ir_context()))
    kernels = {kernel for kernel, _ in calls}
    assert GMM_KERNELS <= kernels and not kernels & ATTENTION_KERNELS and all(m for _, m in calls), calls
    patches = f"tensor<{BATCH}x{CAPACITY}x{VISION.patch_dim}xf32>"
    embed = f"tensor<{VISION.patch_dim}x{VISION.hidden_size}xf32>"    # the tower's patch embedding
    assert [line for line in text.splitlines() if "dot_general" in line and patches in line and embed in line]

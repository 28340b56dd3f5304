"""Generation with images (zaya_jax.generate on a ZayaVL): the prefill with image tokens equals the
whole model's forward, and greedy decoding from the compressed cache equals the argmax of the whole
model's forward over the growing sequence (no cache), for two prompts with one and two images of
different sizes, a sliding layer whose window cuts through an image, and every vision LoRA acting;
on one device and split over a data mesh. The whole model is proven against transformers'
reference in test_vision_model, the processor in test_vision_processor."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.vision_fixtures import IDS, TEXT, VISION, random_vl_model
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.data.vision.prompts import expand_placeholders, prompt_image_batch
from zaya_jax.errors import UserError
from zaya_jax.infer.decode import prefill
from zaya_jax.infer.static_loop import generate_static
from zaya_jax.parallel.mesh import make_mesh
from zaya_jax.model.vision.layout import patch_layout
from zaya_jax.model.vision.vl import ImageBatch, place_image_tokens
from zaya_jax.engine import generate

PROCESSOR = ImageProcessor.for_tower(VISION, min_pixels=64, max_pixels=16 * 32)
NEW = 5


@pytest.fixture(scope="module")
def case():
    text = dataclasses.replace(TEXT, layer_types=("hybrid_sliding", "hybrid"), sliding_window=4)
    model = random_vl_model(text)
    rng = np.random.default_rng(3)
    pictures = [[rng.integers(0, 256, (16, 24, 3), np.uint8), rng.integers(0, 256, (8, 16, 3), np.uint8)],
                [rng.integers(0, 256, (16, 16, 3), np.uint8)]]
    short = [[2, 17, 5, IDS.image, 33, IDS.image, 40, 41], [2, 9, IDS.vision_start, IDS.image, IDS.vision_end, 7]]
    grids = [[PROCESSOR(p)[1] for p in row] for row in pictures]
    prompts = [expand_placeholders(ids, g, IDS) for ids, g in zip(short, grids)]
    return model, pictures, prompts


WIDTH = 32  # every reference forward pads its sequence to this (right padding: the positions before it are unchanged)


@nnx.jit
def _forward(model, ids, images):
    return model(ids, images)[0]


def whole_model_logits(model, prompt: list[int], pictures: list) -> np.ndarray:
    """The whole model's logits at the prompt's last token [V]: one prompt, its images cut by the
    processor and laid out alone, right-padded to WIDTH."""
    patches, grids = PROCESSOR.batch(pictures)
    layout = patch_layout(grids, model.vision.config)
    images = ImageBatch(*(jnp.asarray(a)[None] for a in (patches, *layout[:3])))
    ids = np.zeros((1, WIDTH), np.int32)
    ids[0, :len(prompt)] = prompt
    return np.asarray(_forward(model, jnp.asarray(ids), images)[len(prompt) - 1])


def test_placeholders_expand_to_each_images_span(case):
    _, _, prompts = case
    assert prompts[0][:4] == [2, 17, 5, IDS.vision_start]
    assert prompts[0].count(IDS.image) == 6 + 2 and prompts[1].count(IDS.image) == 4   # 4x6 and 2x4 patches, /4
    assert prompts[1][:3] == [2, 9, IDS.vision_start] and prompts[1].count(IDS.vision_start) == 1
    assert prompts[0][-3:] == [IDS.vision_end, 40, 41]
    with pytest.raises(UserError, match="2 image placeholders .* for 1 images"):
        expand_placeholders([2, IDS.image, IDS.image], [(1, 4, 4)], IDS)


@pytest.mark.parametrize("moe_backend", ["dense", "native"])  # native: text prefills read the stacked experts in place
def test_the_prefill_with_images_equals_the_whole_model(case, moe_backend):
    model, pictures, prompts = case
    if moe_backend != model.text.config.moe_backend:
        model = random_vl_model(dataclasses.replace(model.text.config, moe_backend=moe_backend))
    ids = np.zeros((2, 32), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts])
    batch, tokens = prompt_image_batch(pictures, model, PROCESSOR)
    assert tokens == [8, 4]

    @nnx.jit
    def prefills(model, ids, lengths, images):
        image_tokens = place_image_tokens(ids, model.vision(*images), IDS.image)
        return prefill(model.text, ids, lengths, 40, image_tokens)[0], prefill(model.text, ids, lengths, 40)[0]
    logits, text_only = prefills(model, jnp.asarray(ids), lengths, ImageBatch(*map(jnp.asarray, batch)))
    for b, p in enumerate(prompts):
        want = whole_model_logits(model, p, pictures[b])
        np.testing.assert_allclose(np.asarray(logits[b]), want, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(text_only[b]) - want).max() > 1e-2   # the images are what changed it


def test_greedy_generation_with_images_equals_the_whole_models_argmax(case):
    model, pictures, prompts = case
    new = generate(model, prompts, NEW, images=pictures, image_processor=PROCESSOR, stop_at_eos=False)
    for b, p in enumerate(prompts):
        sequence = list(p)
        for _ in range(NEW):
            sequence.append(int(whole_model_logits(model, sequence, pictures[b]).argmax()))
        assert new[b].tolist() == sequence[len(p):], b
    mesh = make_mesh({"data": 2}, jax.devices()[:2])
    split = generate(model, prompts, NEW, images=pictures, image_processor=PROCESSOR, stop_at_eos=False,
                              mesh=mesh)
    np.testing.assert_array_equal(split, new)


def test_image_prompts_that_do_not_match_their_images_are_refused(case):
    model, pictures, prompts = case
    with pytest.raises(UserError, match="example 1: 4 image placeholders .* for 0 image tokens"):
        generate(model, prompts, 2, images=[pictures[0], []], image_processor=PROCESSOR)
    with pytest.raises(UserError, match="hold image placeholders .* but no images"):
        generate(model, prompts, 2)
    with pytest.raises(UserError, match="images: 1 lists for 2 prompts"):
        generate(model, prompts, 2, images=pictures[:1], image_processor=PROCESSOR)
    with pytest.raises(UserError, match="need a vision-language model"):
        generate(model.text, [[2, 5]], 2, images=[[pictures[1][0]]])


def test_the_cli_generates_from_an_image_file_and_names_a_bad_one(case, tmp_path, capsys):
    from PIL import Image

    from tests.test_infer_cli import run_main
    from zaya_jax.checkpoints.hf_vl import save_vl_hf

    model, pictures, _ = case
    directory = save_vl_hf(model, tmp_path / "vl")
    Image.fromarray(pictures[0][0]).save(tmp_path / "a.png")
    run_main(["--hf", str(directory), "--image", str(tmp_path / "a.png"), "--prompt_ids", f"2,9,{IDS.image},7",
              "--max_new_tokens", "4", "--ignore_eos"])
    out, err = capsys.readouterr()
    printed = out.split()
    grid = ImageProcessor.for_tower(VISION)(pictures[0][0])[1]   # Qwen2-VL's default sizes: 48 x 72 pixels
    assert grid == (1, 12, 18)
    assert f"[image {tmp_path / 'a.png'}: 16x24 -> 48x72 pixels, grid 1 x 12 x 18 patches, 54 image tokens]" in err
    prompt = expand_placeholders([2, 9, IDS.image, 7], [grid], IDS)
    assert printed == [str(t) for t in generate(model, [prompt], 4, images=[pictures[0][:1]],
                                                         stop_at_eos=False)[0]]
    (tmp_path / "b.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="--image .*b.png: cannot read it as an image"):
        run_main(["--hf", str(directory), "--image", str(tmp_path / "b.png"), "--prompt_ids", "2,9"])
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    with pytest.raises(UserError, match="--image .*dot.png: an image of 1x1 pixels is below the processor's minimum: "
                                        "each side must be at least 8 pixels"):
        run_main(["--hf", str(directory), "--image", str(tmp_path / "dot.png"), "--prompt_ids", "2,9"])
    run_main(["--hf", str(directory), "--prompt_ids", "2,9", "--max_new_tokens", "1"])
    assert "note: a vision-language model with no --image: it answers from the text alone" in capsys.readouterr().err
    with pytest.raises(UserError, match="2 image placeholders .* for 1 images"):
        run_main(["--hf", str(directory), "--image", str(tmp_path / "a.png"),
                  "--prompt_ids", f"2,{IDS.image},{IDS.image}"])
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 50
    (tmp_path / "short").mkdir()
    for f in directory.iterdir():
        (tmp_path / "short" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "short" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="the prompt is 58 tokens, 8 too many.* 54 of them are the --image files' "
                                        "placeholders: give smaller images"):
        run_main(["--hf", str(tmp_path / "short"), "--image", str(tmp_path / "a.png"), "--prompt_ids",
                  f"2,9,{IDS.image}"])
    with pytest.raises(UserError, match="--quantize: .* is a zaya1_vl checkpoint"):
        run_main(["--hf", str(directory), "--prompt_ids", "2,9", "--quantize", "int8"])


def test_the_cli_chats_about_an_image(case, tmp_path, capsys, monkeypatch):
    """--chat with --image: the image's span opens the user's message (the chat template's text around it)."""
    import tokenizers
    from PIL import Image

    from tests.test_infer_cli import run_main
    from zaya_jax.checkpoints.hf_vl import save_vl_hf
    from zaya_jax.data.chat_template import PLAIN

    model, pictures, _ = case
    directory = save_vl_hf(model, tmp_path / "vl")
    Image.fromarray(pictures[1][0]).save(tmp_path / "a.png")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "User:": 3, "Assistant:": 4, **{f"w{i}": i for i in range(5, 90)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "tokenizer.json"))
    cli = sys.modules["zaya_jax.generate"]
    prompts = []
    monkeypatch.setattr(cli, "generate",
                        lambda model, ids, *a, **k: prompts.append(ids) or generate_static(model, ids, *a, **k))
    run_main(["--hf", str(directory), "--image", str(tmp_path / "a.png"), "--chat", "w7 w8", "--tokenizer",
              str(tmp_path / "tokenizer.json"), "--chat_template", PLAIN, "--max_new_tokens", "4", "--ignore_eos"])
    printed = capsys.readouterr().out.strip()
    grid = ImageProcessor.for_tower(VISION)(pictures[1][0])[1]
    prompt = [2, 3, IDS.vision_start, *[IDS.image] * (grid[1] * grid[2] // 4), IDS.vision_end, 7, 8, 4]
    assert prompts == [[prompt]]
    want = generate(model, [prompt], 4, images=[pictures[1]], stop_at_eos=False)[0]
    assert printed == tok.decode(want.tolist(), skip_special_tokens=True) and len(printed.split()) >= 2, printed
    (tmp_path / "chat.json").write_text(json.dumps([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "w7 w8"}]}]))                  # TRL's content parts
    run_main(["--hf", str(directory), "--image", str(tmp_path / "a.png"), "--messages", str(tmp_path / "chat.json"),
              "--tokenizer", str(tmp_path / "tokenizer.json"), "--chat_template", PLAIN, "--max_new_tokens", "4"])
    assert prompts[-1] == [prompt]


def test_the_export_carries_its_image_processor_and_is_checked_on_write(case, tmp_path, monkeypatch):
    """save_vl_hf writes the processor it is given (here the digits demo's bounds: an 8x8 image -> 16x16,
    4 image tokens) as preprocessor_config.json and load_vl_processor reads it back; one written without
    its sizes (so transformers' defaults apply: 56x56, 49 image tokens) is refused with nothing written;
    a directory without the file gets transformers' default sizes, said in one line."""
    from zaya_jax.checkpoints import hf_vl

    model = case[0]
    digits = ImageProcessor.for_tower(VISION, min_pixels=256, max_pixels=256)
    lines = []
    directory = hf_vl.save_vl_hf(model, tmp_path / "vl", report=lines.append, processor=digits)
    assert "the image processor's grids, image tokens and patches on 3 probe images" in lines[0]
    assert hf_vl.load_vl_processor(directory, report=pytest.fail) == digits
    honest = hf_vl.preprocessor_config
    monkeypatch.setattr(hf_vl, "preprocessor_config", lambda processor: {
        k: v for k, v in honest(processor).items() if k not in ("size", "min_pixels", "max_pixels")})
    with pytest.raises(hf_vl.ExportMismatch, match=r"cuts a 8x8 image into grid \(1, 14, 14\) \(the source: "
                                                   r"\(1, 4, 4\)\) or other patches; nothing was written"):
        hf_vl.save_vl_hf(model, tmp_path / "bad", processor=digits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vl"]
    (directory / "preprocessor_config.json").unlink()
    notes = []
    assert hf_vl.load_vl_processor(directory, report=notes.append) == ImageProcessor.for_tower(VISION)
    assert len(notes) == 1 and notes[0].startswith(f"note: {directory} has no preprocessor_config.json: images are "
                                                   "resized as transformers' Qwen2-VL image processor does by default")

"""`python -m zaya_jax.serve` with a ZAYA1-VL checkpoint, as OpenAI's client drives it: chat messages
with image_url parts (base64 data: URLs) are answered as `zaya_jax.generate` answers that prompt
and image alone, beside text requests; a URL that is no data: URL, bytes that are no image, an
image below the processor's minimum and image placeholders in a completion prompt are 400s naming
the part. One server (a tiny random ZayaVL saved as a model-only checkpoint whose vision section
records the processor's sizes, with a word-level tokenizer) serves the module."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io

import httpx
import jax
import numpy as np
import pytest
from PIL import Image

from tests.test_serve import metric, started_server
from tests.test_vision_generate import whole_model_logits
from tests.vision_fixtures import IDS, TEXT, VISION, random_vl_model
from zaya_jax.engine import generate

pytestmark = pytest.mark.xdist_group("serve_images")

openai = pytest.importorskip("openai")

NAME = "tiny-vl"
MIN_PIXELS, MAX_PIXELS = 64, 16 * 32     # as tests/test_vision_generate's PROCESSOR
MODEL = dataclasses.replace(TEXT, layer_types=("hybrid_sliding", "hybrid"), sliding_window=4,
                            max_position_embeddings=64)
RNG = np.random.default_rng(11)
PICTURES = [RNG.integers(0, 256, (16, 24, 3), np.uint8), RNG.integers(0, 256, (16, 16, 3), np.uint8)]


def data_url(picture: np.ndarray) -> str:
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model-only checkpoint of a tiny random ZayaVL whose config names its tokenizer and whose
    vision section records the processor's min/max pixels."""
    import tokenizers

    from zaya_jax.config_files import vision_section
    from zaya_jax.checkpoints.orbax_checkpoint import save_model
    from zaya_jax.checkpoints.model_parts import ModelParts
    root = tmp_path_factory.mktemp("served_vl")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "User:": 3, "Assistant:": 4, **{f"w{i}": i for i in range(5, 90)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(root / "tokenizer.json"))
    vision = vision_section(**{f.name: getattr(VISION, f.name) for f in dataclasses.fields(VISION) if f.name != "dtype"},
                            image_token_id=IDS.image, vision_start_token_id=IDS.vision_start,
                            vision_end_token_id=IDS.vision_end, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    vision.fullatt_block_indexes = list(VISION.fullatt_block_indexes)
    model = random_vl_model(MODEL)
    save_model(str(root / NAME), *ModelParts.arrays(model), {"model": dataclasses.asdict(MODEL), "vision":
                                                             vision.to_dict(), "data": {"tokenizer": str(root / "tokenizer.json")}})
    return root / NAME


@pytest.fixture(scope="module")
def server(checkpoint):
    from zaya_jax.data.chat_template import PLAIN
    yield from started_server(["--checkpoint", str(checkpoint), "--slots", "2", "--chunk", "8", "--chat_template",
                               PLAIN, "--warm_up_images", "16x16"], f"model {NAME}, 2 slots of 64 tokens")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(checkpoint):
    from zaya_jax.infer.loading import load_checkpoint
    return load_checkpoint(str(checkpoint))


def test_chats_with_images_beside_text_equal_generate_alone(server, client, checkpoint, model):
    """Two chats, each an image (16x24: 6 image tokens; 16x16: 4) before the text, and a text
    completion, sent at once into 2 slots, with nothing to compile after --warm_up_images 16x16: each one's tokens are generate's for its prompt (the
    chat template's, the image's span where its part was) and images alone, its logprobs the whole
    model's (tower and text model, no cache) over prompt + tokens."""
    from zaya_jax.data.tokenizer import Tokenizer
    from zaya_jax.data.vision.processor import ImageProcessor
    tokenizer = Tokenizer(str(checkpoint.parent / "tokenizer.json"), bos_id=2, eos_id=1, pad_id=0)
    processor = ImageProcessor.for_tower(VISION, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def chat(picture):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                                 {"type": "text", "text": "w7 w8"}]}]
        return client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        chats = [pool.submit(chat, p) for p in PICTURES]
        text = pool.submit(client.completions.create, model=NAME, prompt=[2, 9, 10, 11], max_tokens=5, temperature=0,
                           extra_body={"ignore_eos": True})
        chats, text = [c.result() for c in chats], text.result()
    for picture, answer in zip(PICTURES, chats):
        grid = processor(picture)[1]
        prompt = [2, 3, IDS.vision_start, *[IDS.image] * (grid[1] * grid[2] // 4), IDS.vision_end, 7, 8, 4]
        want = generate(model, [prompt], 5, images=[[picture]], image_processor=processor,
                                 stop_at_eos=False)[0].tolist()
        content = answer.choices[0].logprobs.content
        assert [t.token for t in content] == [tokenizer.decode([t], skip_special=False) for t in want]
        assert answer.usage.prompt_tokens == len(prompt)
        whole = [jax.nn.log_softmax(whole_model_logits(model, prompt + want[:k], [picture]))[t]
                 for k, t in enumerate(want)]
        np.testing.assert_allclose([t.logprob for t in content], whole, atol=2e-4)
    assert text.choices[0].text == tokenizer.decode(
        generate(model, [[2, 9, 10, 11]], 5, stop_at_eos=False)[0].tolist())
    assert metric(server, "zaya_compilations_total") == 0   # --warm_up_images 16x16: both images' bucket


def _png(size) -> str:
    return data_url(np.full((*size, 3), 200, np.uint8))


BAD = [  # (content parts, words the message must hold)
    ([{"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
     "messages[0].content[1]: image_url must be a base64 data: URL"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
     "messages[0].content[0]: cannot read it as an image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "messages[0].content[0]: "),
    ([{"type": "image_url", "image_url": {"url": _png((4, 16))}}],
     "messages[0].content[0]: an image of 4x16 pixels is below the processor's minimum"),
]


def test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving(server, client):
    for parts, words in BAD:
        answer = httpx.post(f"{server[0]}/chat/completions", json={"model": NAME, "messages": [
            {"role": "user", "content": parts}]})
        assert answer.status_code == 400, (words, answer.text)
        assert words in answer.json()["error"]["message"], answer.text
        assert answer.json()["error"]["param"].startswith("messages.0.content.")
    answer = httpx.post(f"{server[0]}/completions", json={"model": NAME, "prompt": [2, IDS.image, 5]})
    assert answer.status_code == 400 and "image placeholder" in answer.json()["error"]["message"]
    ok = client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png((8, 8))}}]}])
    assert ok.choices[0].finish_reason in ("stop", "length")

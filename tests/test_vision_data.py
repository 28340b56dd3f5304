"""Image+text training data: conversations with images in TRL's format -> image_chat documents
(records round trip) -> rows packed whole (zaya_jax.data.vision.image_rows.ImageChatRows): every
conversation and its images in one row, within both the row's positions and its patches, and each
row's patches the processor's cut of its images in the order of their placeholders. The rows are
what ZayaVL takes: each packed conversation's logits equal its logits alone (placement order,
document isolation and bidirectional image attention inside a packed row)."""

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from tests.vision_fixtures import IDS, VISION, random_vl_model
from zaya_jax.data import packing, records
from zaya_jax.data.chat_template import PLAIN, ChatTemplate, ConversationError
from zaya_jax.data.lanes import SequentialStream
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.data.vision.chat import encode_image_chat
from zaya_jax.data.vision.demo_images import QUESTION, digit_conversations
from zaya_jax.data.vision.image_rows import IMAGE_KEYS, ImageChatRows
from zaya_jax.data.vision.processor import ImageProcessor
from zaya_jax.model.vision.layout import patch_row
from zaya_jax.model.vision.vl import ImageBatch

WORDS = ["User:", "Which", "digit", "is", "this?", "Assistant:", *"0123456789", "and"]
PROCESSOR = ImageProcessor.for_tower(VISION, min_pixels=256, max_pixels=1024)  # a digit: 16x16 pixels, 16 patches
SEQ, CAPACITY = 48, 48


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: 3 + i for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer(path, bos_id=2, eos_id=1, pad_id=0)


@pytest.fixture(scope="module")
def documents(tokenizer):
    """Ten held-out digits, each question ending in its index (so that each conversation's ids are its
    own); the third with two images (a second, twice as wide), the fifth too long for a row, the
    seventh with more patches than a row holds, the ninth with an image three times as tall as wide
    (the wide and the tall image: patch grids of 4x6 and 8x4, whose h x h and w x w counts differ)."""
    template = ChatTemplate.load(PLAIN)
    conversations = digit_conversations("heldout")[:10]
    for i, c in enumerate(conversations):
        c["messages"][0]["content"].append({"type": "text", "text": f" {i}"})
    wide = np.concatenate([conversations[3]["images"][0]] * 2, axis=1)          # 8x16 -> 16x24: 24 patches
    conversations[2] = {"images": [conversations[2]["images"][0], wide], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"},
                                     {"type": "text", "text": QUESTION}]}, conversations[2]["messages"][1]]}
    conversations[4]["messages"][0]["content"].append({"type": "text", "text": " Which digit is this?" * 9})
    conversations[6]["images"] = [np.zeros((40, 40, 3), np.uint8)]                 # 40x40 -> 32x32: 64 patches
    conversations[8]["images"] = [np.concatenate([conversations[8]["images"][0]] * 3)]  # 24x8 -> 32x16: 32 patches
    return [encode_image_chat(template, tokenizer, c["messages"], c["images"], PROCESSOR, IDS) for c in conversations]


def test_a_conversation_encodes_to_its_image_span_and_round_trips(tokenizer, documents):
    ids, mask = documents[0].tokens
    word = {w: 3 + i for i, w in enumerate(WORDS)}
    digit = int(digit_conversations("heldout")[0]["messages"][1]["content"][0]["text"])
    question = [word[w] for w in ("Which", "digit", "is", "this?", "0")]
    assert ids.tolist() == [2, word["User:"], IDS.vision_start, *[IDS.image] * 4, IDS.vision_end, *question,
                            word["Assistant:"], word[str(digit)], 1]
    assert mask.tolist() == [0] * 14 + [1, 1]                                     # the answer and its eos
    assert documents[0].images[0].shape == (16, 16, 3)
    assert (documents[2].tokens[0] == IDS.image).sum() == 4 + 6
    two = documents[2]
    stored = records.decode("image_chat", records.encode("image_chat", (*two.tokens, two.images), np.uint16), np.uint16)
    np.testing.assert_array_equal(stored.tokens, two.tokens)
    assert all((a == b).all() for a, b in zip(stored.images, two.images)) and len(stored.images) == 2
    with pytest.raises(ConversationError, match="1 image parts for 2 images"):
        encode_image_chat(ChatTemplate.load(PLAIN), tokenizer, digit_conversations("heldout")[0]["messages"],
                          [np.zeros((8, 8, 3), np.uint8)] * 2, PROCESSOR, IDS)


def packed_rows(documents):
    row_format = ImageChatRows(VISION, CAPACITY)
    packer = packing.RowPacker(SequentialStream(documents, SEQ, row_format), SEQ, 3, 0, row_format)
    rows = []
    while (row := packer.next_row()) is not None:
        rows.append(row)
    return rows


def test_packing_keeps_every_conversation_and_its_images_whole(documents):
    grids = [[PROCESSOR.grid(image) for image in doc.images] for doc in documents]
    assert grids[2][1] == (1, 4, 6) and grids[8][0] == (1, 8, 4)
    for doc, doc_grids in zip(documents, grids):                  # the patches a conversation takes in a row
        assert ImageChatRows(VISION, CAPACITY).piece_patches(doc) == sum(h * w for _, h, w in doc_grids)
    rows = packed_rows(documents)
    seen = []
    for row in rows:
        segments = [s for s in np.unique(row["segment_ids"]) if s]
        patches_used = 0
        images = []
        for s in segments:
            inputs = row["inputs"][row["segment_ids"] == s]
            k = next(i for i, d in enumerate(documents) if np.array_equal(d.tokens[0, :-1], inputs))
            np.testing.assert_array_equal(row["loss_mask"][row["segment_ids"] == s], documents[k].tokens[1, 1:])
            seen.append(k)
            images += documents[k].images
        cut = [PROCESSOR.patches(image) for image in images]
        want = patch_row([p for p, _ in cut], [g for _, g in cut], VISION, CAPACITY)
        for key, array in zip(IMAGE_KEYS, want):
            np.testing.assert_array_equal(row[key], array)
        patches_used = sum(len(p) for p, _ in cut)
        assert patches_used <= CAPACITY and (row["inputs"] == IDS.image).sum() == patches_used // 4
    assert sorted(seen) == [0, 1, 2, 3, 5, 7, 8, 9]            # 4 (too long) and 6 (too many patches) left out
    assert len(rows) == 4 and any(len(np.unique(r["segment_ids"])) - 1 == 3 for r in rows)
    stacked = packing.stack_rows(rows)
    assert stacked["patches"].shape == (4, CAPACITY, VISION.patch_dim) and stacked["inputs"].shape == (4, SEQ)


def test_a_packed_row_gives_each_conversation_its_logits_alone(documents):
    model = random_vl_model()
    row = next(r for r in packed_rows(documents) if len(np.unique(r["segment_ids"])) - 1 >= 2)
    images = ImageBatch(*(jnp.asarray(row[k])[None] for k in IMAGE_KEYS))
    packed = np.asarray(model(jnp.asarray(row["inputs"])[None], images,
                              segment_ids=jnp.asarray(row["segment_ids"])[None])[0])
    for s in [s for s in np.unique(row["segment_ids"]) if s]:
        inputs = row["inputs"][row["segment_ids"] == s]
        doc = next(d for d in documents if np.array_equal(d.tokens[0, :-1], inputs))
        cut = [PROCESSOR.patches(image) for image in doc.images]
        alone_images = ImageBatch(*(jnp.asarray(a)[None] for a in patch_row([p for p, _ in cut], [g for _, g in cut],
                                                                              VISION, CAPACITY)))
        alone = np.asarray(model(jnp.asarray(inputs)[None], alone_images)[0])
        np.testing.assert_allclose(packed[row["segment_ids"] == s], alone, rtol=2e-5, atol=2e-5)


VISION_CONFIG = """
import dataclasses
from zaya_jax.config_files import load_config_file, vision_section
from tests.vision_fixtures import IDS, VISION

def get_config():
    config = load_config_file("configs/tiny.py")
    fields = {f.name: getattr(VISION, f.name) for f in dataclasses.fields(VISION) if f.name != "dtype"}
    fields["fullatt_block_indexes"] = list(VISION.fullatt_block_indexes)
    config.vision = vision_section(**fields, image_token_id=IDS.image, vision_start_token_id=IDS.vision_start,
                                   vision_end_token_id=IDS.vision_end, min_pixels=256, max_pixels=1024)
    return config
"""


def test_the_prepare_cli_reads_conversations_with_image_files(tokenizer, tmp_path):
    """--kind image_chat: TRL-format records whose images are files beside the JSONL become the documents
    encode_image_chat makes of the same images (sized by --vision_config's processor); an unreadable image is
    named by file and line, and a missing --vision_config or a config without a vision section is named."""
    import json

    from PIL import Image

    from zaya_jax.data import prepare, sources
    from zaya_jax.errors import UserError
    conversations = digit_conversations("heldout")[:3]
    (tmp_path / "imgs").mkdir()
    with open(tmp_path / "vl.jsonl", "w") as f:
        for i, c in enumerate(conversations):
            Image.fromarray(c["images"][0]).save(tmp_path / "imgs" / f"{i}.png")
            f.write(json.dumps({"messages": c["messages"], "images": [f"imgs/{i}.png"]}) + "\n")
    (tmp_path / "vl_config.py").write_text(VISION_CONFIG)
    manifest = prepare.prepare_dataset(str(tmp_path / "vl.jsonl"), "jsonl", tokenizer.path, str(tmp_path / "out"),
                                       kind="image_chat", chat_template=PLAIN,
                                       vision_config=str(tmp_path / "vl_config.py"), progress=False)
    assert manifest["kind"] == "image_chat" and manifest["num_documents"] == 3 and manifest["num_images"] == 3
    prepared = sources.open_source("vl", str(tmp_path / "out"), 0.0, "data.sources.vl").train
    template = ChatTemplate.load(PLAIN)
    for i, c in enumerate(conversations):
        want = encode_image_chat(template, tokenizer, c["messages"], c["images"], PROCESSOR, IDS)
        got = prepared[i]
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert len(got.images) == 1 and got.images[0].shape == (16, 16, 3)
        np.testing.assert_array_equal(got.images[0], want.images[0])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": conversations[0]["messages"],
                                                    "images": ["imgs/missing.png"]}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: images\[0\] 'imgs/missing.png': cannot read it as an image"):
        prepare.prepare_dataset(str(tmp_path / "bad.jsonl"), "jsonl", tokenizer.path, str(tmp_path / "out2"),
                                kind="image_chat", chat_template=PLAIN, vision_config=str(tmp_path / "vl_config.py"),
                                progress=False)
    Image.new("RGB", (1, 1)).save(tmp_path / "imgs" / "dot.png")    # below one merged token (8 pixels a side)
    (tmp_path / "dot.jsonl").write_text(json.dumps({"messages": conversations[0]["messages"],
                                                    "images": ["imgs/dot.png"]}) + "\n")
    with pytest.raises(UserError, match=r"dot.jsonl:1: images\[0\] 'imgs/dot.png': an image of 1x1 pixels is below "
                                        r"the processor's minimum: each side must be at least 8 pixels"):
        prepare.prepare_dataset(str(tmp_path / "dot.jsonl"), "jsonl", tokenizer.path, str(tmp_path / "out4"),
                                kind="image_chat", chat_template=PLAIN, vision_config=str(tmp_path / "vl_config.py"),
                                progress=False)
    with pytest.raises(UserError, match="--kind image_chat needs --vision_config FILE"):
        prepare.prepare_dataset(str(tmp_path / "vl.jsonl"), "jsonl", tokenizer.path, str(tmp_path / "out3"),
                                kind="image_chat", chat_template=PLAIN)
    with pytest.raises(UserError, match="configs/tiny.py: the config has no vision section"):
        prepare.prepare_dataset(str(tmp_path / "vl.jsonl"), "jsonl", tokenizer.path, str(tmp_path / "out3"),
                                kind="image_chat", chat_template=PLAIN, vision_config="configs/tiny.py")


def test_image_chat_data_is_refused_where_it_cannot_go():
    from zaya_jax.config import ConfigError
    from zaya_jax.data import kinds
    with pytest.raises(ConfigError, match="hold image_chat data .*: add a vision section to the config"):
        kinds.row_format("image_chat")

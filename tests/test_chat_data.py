"""Chat templates, loss masks of conversations, and chat / preference datasets (prepare -> sources).

References: hand-written expectations of which text is supervised, transformers' own renderer
(`render_jinja_template`, its `{% generation %}` indices), and encode_* called directly.
"""

import json
import os
import re

import numpy as np
import pytest
import tokenizers

from tests.test_data_prepare import data_cli
from zaya_jax.data import chat_template as ct
from zaya_jax.data import prepare, readers, records, sources, tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."}]

# A Gemma-style template written for this test: turns in <start_of_turn>/<end_of_turn>, the model's
# turns inside generation tags, roles checked with raise_exception, bos rendered by the template.
GEMMA_LIKE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "<start_of_turn>model\n{% generation %}{{ message['content'] | trim }}<end_of_turn>\n{% endgeneration %}"
    "{% else %}"
    "<start_of_turn>user\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

CORPUS = [f"User: What is {i}+{i}?\nAssistant: It is {2 * i}. Be brief. And 3+3? model user" for i in range(40)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A byte-level BPE (<pad>=0 <eos>=1 <bos>=2) with Gemma's turn markers as added tokens."""
    path = tokenizer.train_bpe(CORPUS * 3, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=330)
    hf = tokenizers.Tokenizer.from_file(path)
    hf.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    hf.save(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    return tokenizer.Tokenizer(tok_path, bos_id=2, eos_id=1, pad_id=0)


@pytest.fixture(scope="module")
def plain():
    return ct.ChatTemplate.load(ct.PLAIN)


def gemma_template(tmp_path) -> ct.ChatTemplate:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": GEMMA_LIKE, "bos_token": "<bos>", "eos_token": "<eos>"}))
    return ct.ChatTemplate.load(path)


def runs(tok, ids, mask):
    """(decoded text, supervised) of each maximal run of equal mask values."""
    bounds = [0, *np.flatnonzero(np.diff(mask)) + 1, len(ids)]
    return [(tok.decode(ids[a:b], skip_special=False), int(mask[a])) for a, b in zip(bounds, bounds[1:])]


def test_plain_template_mask_supervises_exactly_the_assistant_turns(plain, tok):
    assert plain.render(CHAT) == ("Be brief.\nUser: What is 2+2?\nAssistant: 4<eos>"
                                  "User: And 3+3?\nAssistant: It is 6.<eos>")
    ids, mask = ct.encode_conversation(plain, tok, CHAT)
    assert ids[0] == tok.bos_id and mask.dtype == np.uint8 and ids.dtype == np.int32
    assert runs(tok, ids, mask) == [("<bos>Be brief.\nUser: What is 2+2?\nAssistant: ", 0), ("4<eos>", 1),
                                    ("User: And 3+3?\nAssistant: ", 0), ("It is 6.<eos>", 1)]
    assert ids[mask == 1][-1] == tok.eos_id


@pytest.mark.torch_reference
def test_generation_tags_render_as_transformers_does(tmp_path, tok):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = gemma_template(tmp_path)
    for messages, prompt in ((CHAT, False), (CHAT[:4], True)):
        (expected,), _ = render_jinja_template(conversations=[messages], chat_template=GEMMA_LIKE,
                                               add_generation_prompt=prompt, bos_token="<bos>", eos_token="<eos>")
        assert template.render(messages, add_generation_prompt=prompt) == expected
    # transformers' {% generation %} character indices, rendered with our sentinels for bos/eos
    (text,), (indices,) = render_jinja_template(conversations=[CHAT], chat_template=GEMMA_LIKE,
                                                return_assistant_tokens_mask=True, bos_token=ct.BOS, eos_token=ct.EOS)
    spans = template.spans(CHAT)
    assert "".join(s for s, _ in spans) == text
    starts = np.cumsum([0] + [len(s) for s, _ in spans])
    assert [(int(starts[i]), int(starts[i + 1])) for i, (_, sup) in enumerate(spans) if sup] == indices
    ids, mask = ct.encode_conversation(template, tok, CHAT)
    assert ids[0] == tok.bos_id and list(ids).count(tok.bos_id) == 1  # the template's bos, not a second one
    assert runs(tok, ids, mask) == [
        ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", 0),
        ("4<end_of_turn>\n", 1), ("<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n", 0),
        ("It is 6.<end_of_turn>\n", 1)]
    with pytest.raises(ct.ConversationError, match="roles must alternate"):
        ct.encode_conversation(template, tok, [CHAT[1], CHAT[3], CHAT[2]])


CHATML_NO_EOS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_end_of_turn_is_the_special_token_after_the_assistant_content(plain, tmp_path, tok_path, tok):
    assert ct.end_of_turn_ids(plain, tok) == [tok.eos_id]                      # the answer ends with eos
    gemma = gemma_template(tmp_path)
    assert ct.end_of_turn_ids(gemma, tok) == tok.encode("<end_of_turn>")       # a special token, not eos
    assert tok.is_special(tok.encode("<end_of_turn>")[0]) and len(tok.encode("<end_of_turn>")) == 1
    hf = tokenizers.Tokenizer.from_file(tok_path)
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf.save(str(tmp_path / "chatml.json"))
    chatml_tok = tokenizer.Tokenizer(tmp_path / "chatml.json", bos_id=2, eos_id=1, pad_id=0)
    (tmp_path / "chatml.jinja").write_text(CHATML_NO_EOS)
    chatml = ct.ChatTemplate.load(tmp_path / "chatml.jinja")
    assert ct.end_of_turn_ids(chatml, chatml_tok) == [hf.token_to_id("<|im_end|>")]
    # without <|im_end|> as a special token, the turn ends in plain text: no stop token but eos
    assert ct.end_of_turn_ids(chatml, tok) == []
    (tmp_path / "newline.jinja").write_text(CHATML_NO_EOS.replace("<|im_end|>", ""))
    assert ct.end_of_turn_ids(ct.ChatTemplate.load(tmp_path / "newline.jinja"), chatml_tok) == []
    # a template whose assistant text cannot be found (not prefix-consistent, no generation tags)
    # still generates: no stop token but eos
    (tmp_path / "counting.jinja").write_text("{{ messages | length }}:" + CHATML_NO_EOS)
    counting = ct.ChatTemplate.load(tmp_path / "counting.jinja")
    with pytest.raises(ct.TemplateError, match="not prefix-consistent"):
        counting.spans([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    assert ct.end_of_turn_ids(counting, chatml_tok) == []



def test_transformers_source_puts_bos_first_only_where_the_template_renders_none(plain, tmp_path):
    assert plain.transformers_source() == "{{ bos_token }}" + plain.source
    gemma = gemma_template(tmp_path)  # renders bos itself
    assert gemma.transformers_source() == gemma.source
    (tmp_path / "strict.jinja").write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system "
                                          "first') }}{% endif %}" + CHATML_NO_EOS)
    strict = ct.ChatTemplate.load(tmp_path / "strict.jinja")  # refuses a lone user turn: left as it is
    assert strict.transformers_source() == strict.source


def test_prefix_derived_mask_agrees_with_generation_tags(plain, tmp_path, tok):
    untagged = ct.ChatTemplate(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", plain.source), "untagged.jinja")
    assert plain.has_generation_tags and not untagged.has_generation_tags
    assert untagged.spans(CHAT) == plain.spans(CHAT)
    for a, b in zip(ct.encode_conversation(untagged, tok, CHAT), ct.encode_conversation(plain, tok, CHAT)):
        np.testing.assert_array_equal(a, b)
    gemma = gemma_template(tmp_path)
    untagged_gemma = ct.ChatTemplate(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", gemma.source), "g.jinja")
    assert untagged_gemma.spans(CHAT) == gemma.spans(CHAT)
    # "last message" decorations make the beginnings of a conversation render differently
    inconsistent = ct.ChatTemplate("{% for m in messages %}{% if loop.last %}END {% endif %}{{ m['content'] }}\n"
                                   "{% endfor %}", "inconsistent.jinja")
    with pytest.raises(ct.TemplateError, match="inconsistent.jinja: the chat template is not prefix-consistent"):
        ct.encode_conversation(inconsistent, tok, CHAT)


def test_encode_prompt_is_a_prefix_of_the_conversation(plain, tmp_path, tok):
    for template in (plain, gemma_template(tmp_path)):
        ids, mask = ct.encode_conversation(template, tok, CHAT)
        for turns in (CHAT[:2], CHAT[:4]):
            prompt = ct.encode_prompt(template, tok, turns)
            np.testing.assert_array_equal(ids[:len(prompt)], prompt)
            assert mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0  # the answer starts right after


def test_sentencepiece_spans_continue_without_a_dummy_prefix(plain, tmp_path):
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 5), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=90, minloglevel=2, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", user_defined_symbols=["\n"])
    sp = tokenizer.Tokenizer(tmp_path / "sp.model", bos_id=1, eos_id=2, pad_id=0)
    ids, mask = ct.encode_conversation(plain, sp, CHAT)
    assert [text for text, supervised in runs(sp, ids, mask) if supervised] == ["4", "It is 6."]
    assert sp.decode(ids) == plain.render(CHAT).replace("<eos>", "")  # no space added before any span
    prompt = ct.encode_prompt(plain, sp, CHAT[:2])
    np.testing.assert_array_equal(ids[:len(prompt)], prompt)
    assert sp.encode_pieces(["a b", "c"]) == [sp.encode("a b"), sp.encode("a bc")[len(sp.encode("a b")):]]
    # vocabulary entries and special symbols as SentencePiece defines them (ids 0-2 <unk> <s> </s>)
    assert [sp.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    newline, = sp.encode_pieces(["a", "\n"])[1]  # a user-defined symbol (no dummy-prefix space before it)
    assert sp.is_special(1) and sp.is_special(newline) and not sp.is_special(sp.encode("a")[-1])


def test_end_of_turn_of_a_sentencepiece_model_is_its_user_defined_symbol(tmp_path):
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 5), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=90, minloglevel=2, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity",
                                   user_defined_symbols=["\n", "<start_of_turn>", "<end_of_turn>"])
    sp = tokenizer.Tokenizer(tmp_path / "sp.model", bos_id=1, eos_id=2, pad_id=0)
    end_of_turn, = sp.encode_pieces(["a", "<end_of_turn>"])[1]
    assert sp.id_to_token(end_of_turn) == "<end_of_turn>" and sp.is_special(end_of_turn)
    assert ct.end_of_turn_ids(gemma_template(tmp_path), sp) == [end_of_turn]
    # a turn that ends in a newline and text: "\n" is a user-defined symbol, but whitespace, not a stop
    (tmp_path / "newline.jinja").write_text(CHATML_NO_EOS.replace("<|im_end|>", "").replace(
        "{{ message['content'] }}", "{{ message['content'] }}\nEnd."))
    assert ct.end_of_turn_ids(ct.ChatTemplate.load(tmp_path / "newline.jinja"), sp) == []


def test_encode_preference_standard_and_conversational(plain, tok):
    prompt, chosen, rejected = ct.encode_preference(plain, tok, "What is 2+2?", "4", "5")
    assert prompt[0] == tok.bos_id and tok.decode(prompt) == "What is 2+2?"
    assert list(chosen[-1:]) == [tok.eos_id] and tok.decode(chosen) == "4" and tok.decode(rejected) == "5"
    p, c, r = ct.encode_preference(plain, tok, CHAT[:2], [{"role": "assistant", "content": "4"}],
                                   [{"role": "assistant", "content": "5"}])
    np.testing.assert_array_equal(p, ct.encode_prompt(plain, tok, CHAT[:2]))
    np.testing.assert_array_equal(np.concatenate([p, c]), ct.encode_conversation(plain, tok, CHAT[:3])[0])
    assert tok.decode(r, skip_special=False) == "5<eos>"
    with pytest.raises(ct.ConversationError, match="all be strings or all lists"):
        ct.encode_preference(plain, tok, "q", [{"role": "assistant", "content": "4"}], "5")
    with pytest.raises(ct.ConversationError, match="needs a chat template"):
        ct.encode_preference(None, tok, CHAT[:2], [CHAT[2]], [CHAT[2]])


def test_load_tokenizer_config_forms(tmp_path):
    named = tmp_path / "named" / "tokenizer_config.json"
    os.makedirs(named.parent)
    named.write_text(json.dumps({"chat_template": [{"name": "default", "template": "x"},
                                                   {"name": "tool_use", "template": "y"}]}))
    with pytest.raises(ct.TemplateError, match=r"several named chat templates \(\['default', 'tool_use'\]\)"):
        ct.ChatTemplate.load(named)
    (tmp_path / "none.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ct.TemplateError, match="has no \"chat_template\""):
        ct.ChatTemplate.load(tmp_path / "none.json")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ct.TemplateError, match=r"bad.jinja:2: chat template syntax error"):
        ct.ChatTemplate.load(tmp_path / "bad.jinja")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return str(path)


def conversation(i):
    return [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}]


def test_prepare_chat_roundtrip_with_workers(plain, tmp_path, tok_path, tok):
    for part in range(2):
        write_jsonl(tmp_path / f"chat{part}.jsonl", [{"messages": conversation(10 * part + i)} for i in range(5)])
    manifest = prepare.prepare_dataset(str(tmp_path / "chat*.jsonl"), "jsonl", tok_path, str(tmp_path / "out"),
                                       kind="chat", chat_template=ct.PLAIN, workers=2, progress=False)
    assert manifest["kind"] == "chat" and manifest["num_documents"] == 10
    assert manifest["chat_template"] == plain.record()  # its text too: the file may go (a cache of another checkout)
    source = sources.open_source("sft", str(tmp_path / "out"), 0.1, "data.sources.sft")
    assert source.kind == "chat" and source.train.kind == "chat" and (len(source.train), len(source.heldout)) == (9, 1)
    documents = [source.train[i] for i in range(9)] + [source.heldout[0]]
    expected = [ct.encode_conversation(plain, tok, conversation(10 * part + i)) for part in range(2) for i in range(5)]
    for document, (ids, mask) in zip(documents, expected):
        assert document.dtype == np.int32 and document.shape == (2, len(ids))
        np.testing.assert_array_equal(document[0], ids)
        np.testing.assert_array_equal(document[1], mask)
    assert manifest["num_supervised_tokens"] == sum(int(m.sum()) for _, m in expected)
    assert manifest["num_tokens"] == sum(len(ids) for ids, _ in expected)
    # parquet: a list<struct> column (messages without a "name" read it as None)
    import pyarrow as pa
    import pyarrow.parquet as pq
    chats = [conversation(i) for i in range(3)]
    chats[0][0]["name"] = "ann"
    pq.write_table(pa.table({"conv": chats}), tmp_path / "chat.parquet")
    par = prepare.prepare_dataset(str(tmp_path / "chat.parquet"), "parquet", tok_path, str(tmp_path / "par"),
                                  kind="chat", chat_template=ct.PLAIN, messages_field="conv", progress=False)
    assert par["num_documents"] == 3 and par["text_field"] == "conv"
    np.testing.assert_array_equal(sources.open_source("p", str(tmp_path / "par"), 0.0, "p").train[2][0],
                                  ct.encode_conversation(plain, tok, chats[2])[0])


def test_prepare_preference_roundtrip(plain, tmp_path, tok_path, tok):
    rows = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
            {"prompt": conversation(3)[:1], "chosen": conversation(3)[1:],
             "rejected": [{"role": "assistant", "content": "It is 7."}]}]
    path = write_jsonl(tmp_path / "pref.jsonl", rows)
    manifest = prepare.prepare_dataset(path, "jsonl", tok_path, str(tmp_path / "out"), kind="preference",
                                       chat_template=ct.PLAIN, progress=False)
    assert manifest["kind"] == "preference" and manifest["num_pairs"] == 2
    source = sources.open_source("dpo", str(tmp_path / "out"), 0.0, "data.sources.dpo")
    assert source.kind == "preference"
    for i, row in enumerate(rows):
        parts = ct.encode_preference(plain, tok, row["prompt"], row["chosen"], row["rejected"])
        np.testing.assert_array_equal(source.train[i][0], np.concatenate(parts))
        np.testing.assert_array_equal(source.train[i][1], np.repeat([0, 1, 2], [len(p) for p in parts]))


def test_write_tokenized_every_kind(tmp_path):
    info = {"sha256": "x", "vocab_size": 70000}  # uint32 ids
    docs = {"text": [np.array([2, 5, 69999, 1])],
            "chat": [(np.array([2, 7, 8, 1]), np.array([0, 0, 1, 1]))],
            "preference": [(np.array([2, 3]), np.array([4, 1]), np.array([5, 6, 1]))],
            "image_chat": [(np.array([2, 9, 9, 7, 1]), np.array([0, 0, 0, 1, 1]), [np.arange(48, dtype=np.uint8
                                                                                           ).reshape(4, 4, 3)])]}
    expected = {"text": np.array([2, 5, 69999, 1]), "chat": np.array([[2, 7, 8, 1], [0, 0, 1, 1]]),
                "preference": np.array([[2, 3, 4, 1, 5, 6, 1], [0, 0, 1, 1, 2, 2, 2]]),
                "image_chat": np.array([[2, 9, 9, 7, 1], [0, 0, 0, 1, 1]])}
    for kind in records.KINDS:
        manifest = prepare.write_tokenized(str(tmp_path / kind), docs[kind], tokenizer_info=info, kind=kind)
        assert manifest["kind"] == kind and manifest["dtype"] == "uint32"
        stored = sources.open_source(kind, str(tmp_path / kind), 0.0, kind).train[0]
        if kind == "image_chat":
            stored, (image,) = stored
            np.testing.assert_array_equal(image, docs[kind][0][2][0])
            assert manifest["num_images"] == 1 and manifest["num_supervised_tokens"] == 2
        np.testing.assert_array_equal(stored, expected[kind])


def test_bad_chat_records_are_named_by_file_and_line(tmp_path, tok_path):
    good = {"messages": conversation(1)}
    bad = [({"conversation": conversation(1)}, "no list field 'messages' in this JSON line"),
           ({"messages": [{"role": "bot", "content": "hi"}, conversation(1)[1]]}, "role 'bot' is not one of"),
           ({"messages": [{"role": "user", "content": 3}, conversation(1)[1]]}, "content is a int, not a string"),
           ({"messages": [conversation(1)[0], {"role": "assistant", "content": " "}]}, "empty assistant content"),
           ({"messages": conversation(1)[:1]}, "has no assistant turn")]
    path = write_jsonl(tmp_path / "chat.jsonl", [good] + [row for row, _ in bad])
    for i, (row, message) in enumerate(bad):
        one = write_jsonl(tmp_path / f"bad{i}.jsonl", [good, row])
        with pytest.raises(readers.InputError, match=re.escape(f"{one}:2: ") + ".*" + re.escape(message)):
            prepare.prepare_dataset(one, "jsonl", tok_path, str(tmp_path / f"o{i}"), kind="chat",
                                    chat_template=ct.PLAIN, progress=False)
    manifest = prepare.prepare_dataset(path, "jsonl", tok_path, str(tmp_path / "skip"), kind="chat",
                                       chat_template=ct.PLAIN, skip_bad=True, progress=False)
    assert manifest["num_documents"] == 1 and manifest["skipped_lines"] == len(bad)
    done = data_cli("prepare", "--kind", "chat", "--chat_template", ct.PLAIN, "--input", path, "--format", "jsonl",
                    "--tokenizer", tok_path, "--output", tmp_path / "cli", "--quiet")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {path}:2: no list field 'messages'")
    assert done.stderr.strip().splitlines()[1].strip() == \
        "(--skip_bad skips bad files and lines and counts them in the manifest)"
    pref = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                                                 {"prompt": "q", "chosen": conversation(1)[1:], "rejected": "b"}])
    with pytest.raises(readers.InputError, match=re.escape(f"{pref}:2: ") + "prompt, chosen and rejected must"):
        prepare.prepare_dataset(pref, "jsonl", tok_path, str(tmp_path / "p"), kind="preference", progress=False)


def test_default_chat_template_lookup(tmp_path, tok_path, plain):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(1)}])
    done = data_cli("prepare", "--kind", "chat", "--input", path, "--format", "jsonl", "--tokenizer", tok_path,
                    "--output", tmp_path / "cli", "--quiet")
    beside = os.path.join(os.path.dirname(tok_path), "tokenizer_config.json")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: --kind chat needs a chat template and {beside} does not exist: "
                                  "pass --chat_template FILE")
    own = tmp_path / "tok"
    os.makedirs(own)
    tokenizer.train_bpe(CORPUS, own / "tokenizer.json", vocab_size=300)
    (own / "tokenizer_config.json").write_text(json.dumps({"chat_template": plain.source}))
    manifest = prepare.prepare_dataset(path, "jsonl", str(own / "tokenizer.json"), str(tmp_path / "out"), kind="chat",
                                       progress=False)
    assert manifest["chat_template"] == {**plain.record(), "path": str(own / "tokenizer_config.json")}

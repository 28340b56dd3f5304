"""Tokenizers, the preparation CLI, and bad input files (errors name the file and line)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.train_helpers import REPO, cli_env
from zaya_jax.data import prepare, readers, sources, tokenizer


def data_cli(module: str, *args) -> subprocess.CompletedProcess:
    """python -m zaya_jax.data.MODULE ARGS."""
    return subprocess.run([sys.executable, "-m", f"zaya_jax.data.{module}", *map(str, args)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120)

TEXTS = [f"Document {i}: the quick brown fox jumps over {i * 7} lazy dogs.\nSecond line {i}." for i in range(60)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return tokenizer.train_bpe(TEXTS * 3, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=320)


def write_jsonl(path, texts, extra_lines=()):
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        f.writelines(extra_lines)
    return str(path)


def read_records(output_dir):
    manifest = sources.load_manifest(str(output_dir), "test")
    source = sources.DocumentSource([os.path.join(output_dir, s["file"]) for s in manifest["shards"]],
                                    manifest["dtype"], 0, manifest["num_documents"])
    return [source[i] for i in range(len(source))]


def test_bpe_tokenizer_roundtrip_and_special_ids(tok_path):
    tok = tokenizer.Tokenizer(tok_path, bos_id=2, eos_id=1, pad_id=0)
    assert tok.vocab_size == 320 and tok.kind == "hf"
    doc = tok.encode_document(TEXTS[3])
    assert doc[0] == 2 and doc[-1] == 1 and doc.dtype == np.int32
    assert tok.decode(doc) == TEXTS[3]
    assert tok.sha256 == tokenizer.file_sha256(tok_path)
    with pytest.raises(ValueError, match="bos_id=9999"):
        tokenizer.Tokenizer(tok_path, bos_id=9999, eos_id=1, pad_id=0)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        tokenizer.Tokenizer("/nope.json", bos_id=2, eos_id=1, pad_id=0)


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 5), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=80, minloglevel=2)
    tok = tokenizer.Tokenizer(tmp_path / "sp.model", bos_id=1, eos_id=2, pad_id=0)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 80
    doc = tok.encode_document("the quick brown fox")
    assert doc[0] == 1 and doc[-1] == 2
    assert tok.decode(doc) == "the quick brown fox"


def test_train_tokenizer_cli(tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    done = data_cli("train_tokenizer", "--input", data, "--format", "jsonl", "--vocab-size", "300",
                    "--output", tmp_path / "t.json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokenizer"] == str(tmp_path / "t.json")
    assert tokenizer.Tokenizer(tmp_path / "t.json", bos_id=2, eos_id=1, pad_id=0).vocab_size == 300


def test_prepare_jsonl_writes_documents_and_manifest(tmp_path, tok_path):
    os.makedirs(tmp_path / "in")
    a = write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS[:30])
    b = write_jsonl(tmp_path / "in" / "b.jsonl", TEXTS[30:] + [""])  # an empty document is skipped
    out = tmp_path / "out"
    done = data_cli("prepare", "--input", tmp_path / "in" / "*.jsonl", "--format", "jsonl", "--tokenizer",
                    tok_path, "--output", out, "--quiet")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["num_documents"] == 60 and summary["shards"] == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == [a, b]
    assert manifest["tokenizer"]["sha256"] == tokenizer.file_sha256(tok_path)
    assert manifest["dtype"] == "uint16"
    assert [s["documents"] for s in manifest["shards"]] == [30, 30]
    assert manifest["shards"][1]["empty_documents"] == 1
    tok = tokenizer.Tokenizer(tok_path, bos_id=2, eos_id=1, pad_id=0)
    records = read_records(out)
    assert sum(len(r) for r in records) == manifest["num_tokens"] == sum(s["tokens"] for s in manifest["shards"])
    for text, record in zip(TEXTS, records):
        np.testing.assert_array_equal(record, tok.encode_document(text))


def test_prepare_rerun_skips_finished_shards(tmp_path, tok_path, monkeypatch):
    for i in range(3):
        write_jsonl(tmp_path / f"in{i}.jsonl", TEXTS[i * 20:(i + 1) * 20])
    pattern, out = str(tmp_path / "in*.jsonl"), str(tmp_path / "out")
    first = prepare.prepare_dataset(pattern, "jsonl", str(tok_path), out, progress=False)
    os.remove(os.path.join(out, "shard-00001-of-00003.json"))  # as if killed while writing shard 1
    done = []
    real = prepare.run_shard
    monkeypatch.setattr(prepare, "run_shard", lambda task, report: done.append(task.index) or real(task, report))
    second = prepare.prepare_dataset(pattern, "jsonl", str(tok_path), out, progress=False)
    assert done == [1]
    assert first == second
    with pytest.raises(ValueError, match="text_field differ"):
        prepare.prepare_dataset(pattern, "jsonl", str(tok_path), out, text_field="body", progress=False)


def test_prepare_parallel_workers_match_serial(tmp_path, tok_path):
    for i in range(2):
        write_jsonl(tmp_path / f"in{i}.jsonl", TEXTS[i * 30:(i + 1) * 30])
    pattern = str(tmp_path / "in*.jsonl")
    serial = prepare.prepare_dataset(pattern, "jsonl", str(tok_path), str(tmp_path / "s"), progress=False)
    parallel = prepare.prepare_dataset(pattern, "jsonl", str(tok_path), str(tmp_path / "p"), workers=2,
                                       progress=False)
    assert serial["num_tokens"] == parallel["num_tokens"]
    for x, y in zip(read_records(tmp_path / "s"), read_records(tmp_path / "p")):
        np.testing.assert_array_equal(x, y)


def test_prepare_text_and_parquet_formats(tmp_path, tok_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(TEXTS[i])
    text = prepare.prepare_dataset(str(tmp_path / "*.txt"), "text", str(tok_path), str(tmp_path / "t"),
                                   progress=False)
    assert text["num_documents"] == 3
    pq.write_table(pa.table({"content": TEXTS[:7]}), tmp_path / "d.parquet")
    par = prepare.prepare_dataset(str(tmp_path / "d.parquet"), "parquet", str(tok_path), str(tmp_path / "p"),
                                  text_field="content", progress=False)
    assert par["num_documents"] == 7
    tok = tokenizer.Tokenizer(tok_path, bos_id=2, eos_id=1, pad_id=0)
    np.testing.assert_array_equal(read_records(tmp_path / "p")[6], tok.encode_document(TEXTS[6]))


def bad_inputs(tmp_path):
    """(file, format, expected 'file:line' or 'file' in the message)."""
    malformed = write_jsonl(tmp_path / "malformed.jsonl", TEXTS[:2], ['{"text": "ok"}\n', '{"text": broken\n'])
    no_field = write_jsonl(tmp_path / "nofield.jsonl", TEXTS[:1], ['{"body": "x"}\n'])
    (tmp_path / "latin1.txt").write_bytes(b"fine line\ncaf\xe9 au lait\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    return [(malformed, "jsonl", f"{malformed}:4: malformed JSON"),
            (no_field, "jsonl", f"{no_field}:2: no string field 'text'"),
            (str(tmp_path / "latin1.txt"), "text", f"{tmp_path / 'latin1.txt'}:2: not valid UTF-8"),
            (str(tmp_path / "empty.jsonl"), "jsonl", f"{tmp_path / 'empty.jsonl'}: empty file"),
            (str(tmp_path / "empty.txt"), "text", f"{tmp_path / 'empty.txt'}: empty file"),
            (str(tmp_path / "garbage.parquet"), "parquet", f"{tmp_path / 'garbage.parquet'}: not a readable parquet")]


def test_bad_inputs_name_file_and_line(tmp_path, tok_path):
    for i, (path, fmt, message) in enumerate(bad_inputs(tmp_path)):
        with pytest.raises(readers.InputError) as error:
            prepare.prepare_dataset(path, fmt, str(tok_path), str(tmp_path / f"out{i}"), progress=False)
        assert str(error.value).startswith(message), (str(error.value), message)
    malformed = str(tmp_path / "malformed.jsonl")
    done = data_cli("prepare", "--input", malformed, "--format", "jsonl", "--tokenizer", tok_path,
                    "--output", tmp_path / "cli", "--quiet")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {malformed}:4: malformed JSON")
    assert done.stderr.strip().splitlines()[1].strip() == \
        "(--skip_bad skips bad files and lines and counts them in the manifest)"
    assert len(done.stderr.strip().splitlines()) == 2
    assert not (tmp_path / "cli").exists()  # no plan.json, no half-written shard: the output as it was
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    done = data_cli("prepare", "--input", malformed, "--format", "jsonl", "--tokenizer", tok_path,
                    "--output", tmp_path / "kept", "--quiet")
    assert done.returncode == 2 and os.listdir(tmp_path / "kept") == ["notes.txt"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        prepare.prepare_dataset(str(tmp_path / "missing*.jsonl"), "jsonl", str(tok_path), str(tmp_path / "x"))


def test_help_shows_the_examples_as_written():
    done = data_cli("prepare", "--help")
    assert done.returncode == 0
    assert "--format jsonl \\\n        --tokenizer /models/gemma3/tokenizer.json" in done.stdout


def test_skip_bad_skips_and_counts(tmp_path, tok_path):
    bad_inputs(tmp_path)
    manifest = prepare.prepare_dataset([str(tmp_path / "*.jsonl"), str(tmp_path / "*.txt")], "jsonl", str(tok_path),
                                       str(tmp_path / "out"), skip_bad=True, num_shards=1, progress=False)
    # malformed.jsonl: 3 good lines, 1 bad; nofield.jsonl: 1 good, 1 bad; empty.jsonl: empty file;
    # the two .txt files are not JSON at all: every non-blank line is bad.
    assert manifest["num_documents"] == 4
    assert manifest["skipped_lines"] == 2 + 2
    assert manifest["skipped_files"] == 2  # empty.jsonl, empty.txt
    assert any("malformed.jsonl:4" in e for e in manifest["shards"][0]["errors"])

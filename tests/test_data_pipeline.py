"""The Grain curriculum pipeline on small synthetic sources written to a temp dir.

Every token id in the synthetic corpus is unique and ids run consecutively within a document,
so any token tells which source and document it came from.
"""

import collections
import json

import grain
import ml_collections
import numpy as np
import pytest

from zaya_jax.data import build_eval_batches, build_pipeline, prepare, zaya1_base_data_config

SOURCE_STARTS = {"a": 1, "b": 20_000, "c": 40_000}
DOCS_PER_SOURCE = 120
TOKENIZER = {"sha256": "synthetic", "vocab_size": 65536, "bos_id": 2, "eos_id": 1, "pad_id": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{source: (dir, documents)}, 2 shards each, documents of 2..120 tokens."""
    root, result = tmp_path_factory.mktemp("synthetic"), {}
    rng = np.random.default_rng(0)
    for name, start in SOURCE_STARTS.items():
        docs, next_id = [], start
        for n in rng.integers(2, 121, DOCS_PER_SOURCE):
            docs.append(np.arange(next_id, next_id + n))
            next_id += n
        prepare.write_tokenized(str(root / name), docs, tokenizer_info=TOKENIZER, num_shards=2)
        result[name] = (str(root / name), docs)
    return result


def phase(name, batches, seq_len, rope_theta, batch, weights):
    return ml_collections.ConfigDict(dict(name=name, token_budget=batches * batch * seq_len, seq_len=seq_len,
                                          rope_theta=rope_theta, global_batch_size=batch, weights=weights))


def make_config(corpus, budgets=(6, 4, 3)):
    return ml_collections.ConfigDict(dict(
        sources={n: path for n, (path, _) in corpus.items()}, tokenizer="unused",
        phases=(phase("one", budgets[0], 32, 1e4, 8, {"a": 0.6, "b": 0.3, "c": 0.1}),
                phase("two", budgets[1], 64, 1e4, 8, {"b": 1.0, "c": 1.0}),
                phase("three", budgets[2], 48, 1e6, 4, {"a": 1.0, "b": 0.0, "c": 3.0})),
        pad_id=0, heldout_fraction=0.05, packing_bins=4, worker_count=0, worker_buffer_size=1,
        prefetch_buffer_size=2, eval=dict(seq_len=32, batch_size=4, max_batches=0)))


def draw(pipeline, n):
    return [next(pipeline) for _ in range(n)]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def doc_index(corpus):
    """token id -> (source, document index)."""
    owner = {}
    for name, (_, docs) in corpus.items():
        for i, d in enumerate(docs):
            owner.update((int(t), (name, i)) for t in d)
    return owner


def test_batches_are_packed_documents_of_the_phase_sources(corpus):
    owner, pipeline = doc_index(corpus), build_pipeline(make_config(corpus))
    assert pipeline.vocab_size == 65536
    heldout_start = DOCS_PER_SOURCE - round(DOCS_PER_SOURCE * 0.05)
    for batch in pipeline:  # all three phases
        ph = pipeline.phase
        allowed = {n for n, _ in ph.weights}
        assert batch["inputs"].shape == (ph.global_batch_size, ph.seq_len)
        assert {k: v.dtype.name for k, v in batch.items()} == {"inputs": "int32", "targets": "int32",
                                                                "segment_ids": "int32", "positions": "int32",
                                                                "loss_mask": "float32"}
        for r in range(ph.global_batch_size):
            seg, pos, inputs, targets = (batch[k][r] for k in ("segment_ids", "positions", "inputs", "targets"))
            real = seg > 0
            assert np.all(real[:real.sum()]), "padding only at the end of a row"
            np.testing.assert_array_equal(batch["loss_mask"][r], real.astype(np.float32))
            assert np.all(inputs[~real] == 0) and np.all(targets[~real] == 0) and np.all(pos[~real] == 0)
            for s in range(1, seg.max() + 1):
                idx = np.flatnonzero(seg == s)
                np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart per document
                np.testing.assert_array_equal(targets[idx], inputs[idx] + 1)  # the next token of the document
                docs = {owner[int(t)] for t in np.concatenate([inputs[idx], targets[idx]])}
                assert len(docs) == 1, "a segment never crosses documents"
                source, doc = docs.pop()
                assert source in allowed and doc < heldout_start
    assert pipeline.phase.index == 2
    with pytest.raises(StopIteration):
        next(pipeline)


def test_mixture_proportions_follow_weights(corpus):
    config = make_config(corpus, budgets=(150, 1, 1))
    tokens = collections.Counter()
    for batch in draw(build_pipeline(config), 150):
        real = batch["targets"][batch["loss_mask"] > 0]
        for name, start in SOURCE_STARTS.items():
            tokens[name] += int(((real >= start) & (real < start + 20_000)).sum())
    total = sum(tokens.values())
    for name, weight in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
        assert abs(tokens[name] / total - weight) < 0.015, (tokens, total)


def test_same_seed_same_batches_other_seed_differs(corpus):
    config = make_config(corpus)
    first = draw(build_pipeline(config, seed=3), 8)
    assert_same(first, draw(build_pipeline(config, seed=3), 8))
    other = draw(build_pipeline(config, seed=4), 8)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(first, other))


@pytest.mark.parametrize("process_count", [2, 4])
def test_each_process_gets_its_slice_of_the_global_batch(corpus, process_count):
    config = make_config(corpus)
    whole = draw(build_pipeline(config, seed=1), 13)
    parts = [draw(build_pipeline(config, seed=1, process_index=p, process_count=process_count), 13)
             for p in range(process_count)]
    for i, batch in enumerate(whole):
        rows = batch["inputs"].shape[0] // process_count
        for p in range(process_count):
            for k in batch:
                np.testing.assert_array_equal(parts[p][i][k], batch[k][p * rows:(p + 1) * rows])


def test_phases_change_at_their_token_budgets(corpus):
    config = make_config(corpus)
    config.phases[0].token_budget = 2 * 8 * 32 + 1  # a partial batch's worth still takes a whole batch
    config.phases[1].token_budget = 2 * 8 * 64
    config.phases[2].token_budget = 4 * 48
    pipeline = build_pipeline(config)
    assert pipeline.phase.index == 0
    seen = []
    for batch in pipeline:
        ph = pipeline.phase
        assert batch["inputs"].shape == (ph.global_batch_size, ph.seq_len)
        seen.append((ph.name, ph.seq_len, ph.rope_theta))
    assert seen == [("one", 32, 1e4)] * 3 + [("two", 64, 1e4)] * 2 + [("three", 48, 1e6)]
    assert [p.num_batches for p in pipeline.phases] == [3, 2, 1]


@pytest.mark.parametrize("taken", [3, 8, 10])  # mid phase one, mid phase two, end of phase two
def test_state_restores_to_the_same_next_batches(corpus, taken):
    config = make_config(corpus)
    pipeline = build_pipeline(config, seed=5)
    draw(pipeline, taken)
    state = json.loads(json.dumps(pipeline.get_state()))
    expected = draw(pipeline, 13 - taken)
    restored = build_pipeline(config, seed=5)
    restored.set_state(state)
    assert restored.phase.index == (0 if taken < 6 else 1)  # a restart inside phase two stays in phase two
    assert_same(expected, draw(restored, 13 - taken))
    with pytest.raises(ValueError, match="different pipeline"):
        build_pipeline(config, seed=6).set_state(state)


def test_orbax_checkpoint_roundtrip(corpus, tmp_path):
    import orbax.checkpoint as ocp
    config = make_config(corpus)
    pipeline = build_pipeline(config)
    draw(pipeline, 7)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(pipeline)))
        manager.wait_until_finished()
    expected = draw(pipeline, 4)
    restored = build_pipeline(config)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    assert_same(expected, draw(restored, 4))


def test_worker_processes_give_the_same_batches_and_restore(corpus):
    config = make_config(corpus)
    reference = draw(build_pipeline(config), 4)
    config.worker_count = 2
    pipeline = build_pipeline(config)
    try:
        assert_same(reference[:2], draw(pipeline, 2))
        state = json.loads(json.dumps(pipeline.get_state()))
    finally:
        pipeline.close()
    restored = build_pipeline(config)
    try:
        restored.set_state(state)
        assert_same(reference[2:], draw(restored, 2))
    finally:
        restored.close()


def test_eval_batches_cover_each_heldout_target_once(corpus):
    config = make_config(corpus)
    batches = build_eval_batches(config)
    halves = [build_eval_batches(config, process_index=p, process_count=2) for p in range(2)]
    for name, (_, docs) in corpus.items():
        held = docs[DOCS_PER_SOURCE - round(DOCS_PER_SOURCE * 0.05):]
        got = collections.Counter(int(t) for b in batches[name] for t in b["targets"][b["loss_mask"] > 0])
        assert got == collections.Counter(int(t) for d in held for t in d[1:])
        assert all(b["inputs"].shape == (4, 32) for b in batches[name])
        for i, b in enumerate(batches[name]):
            halves_rows = [halves[p][name][i]["inputs"] for p in range(2)]
            np.testing.assert_array_equal(np.concatenate(halves_rows), b["inputs"])
    assert len(build_eval_batches(config, max_batches=1)["a"]) == 1


def _empty_source(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "manifest.json").write_text(json.dumps(
        {"num_documents": 0, "shards": [], "tokenizer": TOKENIZER, "dtype": "uint16"}))
    return str(tmp_path / "empty")


@pytest.mark.parametrize("mutate,error,message", [
    (lambda c, t: setattr(c.sources, "a", str(t / "nope")), FileNotFoundError, r"data.sources.a: .*nope"),
    (lambda c, t: setattr(c.sources, "a", str(t)), FileNotFoundError, r"data.sources.a: .*manifest.json"),
    (lambda c, t: setattr(c.sources, "a", _empty_source(t)), ValueError, r"data.sources.a: .*empty"),
    (lambda c, t: c.phases[0].weights.update({"zzz": 1.0}), ValueError,
     r"data.phases\[0\].weights names unknown source 'zzz'"),
    (lambda c, t: c.phases[1].weights.update({"b": 0.0, "c": 0.0}), ValueError,
     r"data.phases\[1\].weights must sum to a positive number"),
    (lambda c, t: c.phases[0].weights.update({"a": -1.0}), ValueError, r"data.phases\[0\].weights.a"),
    (lambda c, t: setattr(c.phases[2], "seq_len", 0), ValueError, r"data.phases\[2\].seq_len must be a positive"),
    # a config error is reported before any file is looked at
    (lambda c, t: (setattr(c.phases[0], "seq_len", -4), setattr(c.sources, "a", "/nope")), ValueError,
     r"data.phases\[0\].seq_len"),
    (lambda c, t: setattr(c, "heldout_fraction", 1.0), ValueError, r"data.heldout_fraction"),
])
def test_bad_config_names_the_field(corpus, tmp_path, mutate, error, message):
    config = make_config(corpus)
    mutate(config, tmp_path)
    with pytest.raises(error, match=message):
        build_pipeline(config)


def test_bad_layout_and_foreign_sources(corpus, tmp_path):
    config = make_config(corpus)
    with pytest.raises(ValueError, match="split evenly over 3 processes"):
        build_pipeline(config, process_count=3)
    config.worker_count = 3
    with pytest.raises(ValueError, match="worker_count=3 must divide"):
        build_pipeline(config)
    config.worker_count = 0
    prepare.write_tokenized(str(tmp_path / "other"), [np.arange(1, 9)], tokenizer_info={**TOKENIZER, "sha256": "x"})
    config.sources.c = str(tmp_path / "other")
    with pytest.raises(ValueError, match="different tokenizers"):
        build_pipeline(config)


def test_zaya1_placeholders_fail_naming_the_path():
    config = zaya1_base_data_config()
    phases = [(p.name, p.seq_len, p.rope_theta, p.token_budget) for p in config.phases]
    assert phases[0][1:] == (4096, 1e4, 8 * 10**12) and phases[1][1:] == (4096, 1e4, 4 * 10**12)
    assert phases[2][1:3] == (32768, 1e6)
    with pytest.raises(FileNotFoundError, match=r"data.sources.\w+: data directory '/data/zaya1/\w+' does not exist"):
        build_pipeline(config)

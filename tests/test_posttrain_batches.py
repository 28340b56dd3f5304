"""SFT rows (chat documents) and DPO rows (preference pairs): masks, whole pairs, truncation,
resume and process independence. References: hand-written rows, a per-token mask table, and an
independent decoding of rows back into pairs with a step-by-step truncation loop."""

import json

import ml_collections
import numpy as np
import pytest

from zaya_jax.config import ConfigError
from zaya_jax.data import (build_eval_batches, build_pipeline, curriculum, kinds, lanes, packing, pipeline, prepare,
                           preference_rows, sources)
from zaya_jax.data.preference_rows import PAIRS
from tests.test_data_packing import ListSource  # a DocumentSource stand-in; documents [n] or [2, n]


def chat_docs(num_docs, max_len, seed, start=1):
    """Chat documents [2, n] with unique, consecutive ids; returns (docs, {token id: mask})."""
    rng = np.random.default_rng(seed)
    docs, mask_of, next_id = [], {}, start
    for n in rng.integers(2, max_len + 1, num_docs):
        ids = np.arange(next_id, next_id + n)
        mask = rng.integers(0, 2, n)
        mask[0] = 0  # bos
        docs.append(np.stack([ids, mask]))
        mask_of.update(zip(ids.tolist(), mask.tolist()))
        next_id += n
    return docs, mask_of


def preference_docs(num_docs, seed, start=1, prompt_len=(1, 6), completion_len=(1, 12)):
    """Preference documents [2, P+C+R] with unique ids; returns (docs, {first prompt id: (p, c, r)})."""
    rng = np.random.default_rng(seed)
    docs, pairs, next_id = [], {}, start
    for _ in range(num_docs):
        p = rng.integers(*prompt_len, endpoint=True)
        c, r = rng.integers(*completion_len, size=2, endpoint=True)
        parts = [np.arange(next_id, next_id + n) for n in (p, c, r)]
        next_id += p + c + r
        docs.append(np.stack([np.concatenate(parts), np.repeat([0, 1, 2], [p, c, r])]))
        pairs[int(parts[0][0])] = tuple(parts)
    return docs, pairs


def reference_fit(p, c, r, seq_len):
    """Completion lengths kept, one token at a time: cut the longer (the chosen on a tie)."""
    if p < 1 or c < 1 or r < 1:
        return 0, 0
    while 2 * p + c + r - 2 > seq_len:
        if c >= r:
            c -= 1
        else:
            r -= 1
    return (c, r) if c >= 1 and r >= 1 else (0, 0)


def decode_sequences(row):
    """[(token ids [m], loss_mask [m-1], positions [m-1])] per segment, from a row alone."""
    seg, out = row["segment_ids"], []
    for s in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == s)
        assert len(idx) and np.all(np.diff(idx) == 1), "a segment is one run of positions"
        out.append((np.append(row["inputs"][idx], row["targets"][idx][-1]), row["loss_mask"][idx],
                    row["positions"][idx]))
    return out


def check_pair_rows(rows, pairs, seq_len):
    """Every row holds whole pairs (segments 2j-1, 2j) equal to a source pair fitted by
    reference_fit; returns the first prompt id of each pair seen, in order."""
    seen = []
    for row in rows:
        assert all(row[k].shape == (seq_len,) for k in packing.ROW_KEYS)
        assert int(row["segment_ids"].max(initial=0)) <= seq_len
        pad = row["segment_ids"] == 0
        assert np.all(row["inputs"][pad] == 0) and np.all(row["loss_mask"][pad] == 0)
        sequences = decode_sequences(row)
        assert len(sequences) % 2 == 0, "a pair is never split across rows"
        for (ids_c, mask_c, pos_c), (ids_r, mask_r, pos_r) in zip(sequences[::2], sequences[1::2]):
            prompt, chosen, rejected = pairs[int(ids_c[0])]
            kept_c, kept_r = reference_fit(len(prompt), len(chosen), len(rejected), seq_len)
            p = len(prompt)
            np.testing.assert_array_equal(ids_c, np.concatenate([prompt, chosen[:kept_c]]))
            np.testing.assert_array_equal(ids_r, np.concatenate([prompt, rejected[:kept_r]]))
            for mask, pos, kept in ((mask_c, pos_c, kept_c), (mask_r, pos_r, kept_r)):
                np.testing.assert_array_equal(pos, np.arange(p + kept - 1))  # positions restart
                # target t is token t+1: a completion token iff t+1 >= P
                np.testing.assert_array_equal(mask, (np.arange(1, p + kept) >= p).astype(np.float32))
            seen.append(int(ids_c[0]))
    return seen


def test_sft_rows_match_a_hand_computed_layout():
    doc_a = [[2, 10, 11, 12, 13, 14, 15, 16], [0, 0, 0, 1, 1, 0, 1, 1]]
    doc_b = [[2, 20, 21], [0, 1, 1]]
    stream = lanes.SequentialStream(ListSource([doc_a, doc_b]), seq_len=5)
    packer = packing.RowPacker(stream, seq_len=5, num_bins=1, pad_id=0)
    row1, row2 = packer.next_row(), packer.next_row()
    assert packer.next_row() is None
    # doc_a: chunk [0:6] (5 positions, fills row 1), then chunk [5:8] overlapping by one token
    expected1 = dict(inputs=[2, 10, 11, 12, 13], targets=[10, 11, 12, 13, 14], segment_ids=[1, 1, 1, 1, 1],
                     positions=[0, 1, 2, 3, 4], loss_mask=[0, 0, 1, 1, 0])
    expected2 = dict(inputs=[14, 15, 2, 20, 0], targets=[15, 16, 20, 21, 0], segment_ids=[1, 1, 2, 2, 0],
                     positions=[0, 1, 0, 1, 0], loss_mask=[1, 1, 1, 1, 0])
    for row, expected in ((row1, expected1), (row2, expected2)):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(row[k], expected[k], err_msg=k)
        assert row["loss_mask"].dtype == np.float32 and row["inputs"].dtype == np.int32


def test_sft_lane_rows_mask_exactly_the_supervised_targets():
    docs, mask_of = chat_docs(60, 40, seed=0)
    stream = lanes.LaneStream([ListSource(docs)], [1.0], [3], 0, 1, seq_len=16)
    packer = packing.RowPacker(stream, seq_len=16, num_bins=4, pad_id=0)
    rows = [packer.next_row() for _ in range(60)]
    targets = 0
    for row in rows:
        real = row["segment_ids"] > 0
        expected = np.array([mask_of[int(t)] if r else 0 for t, r in zip(row["targets"], real)], np.float32)
        np.testing.assert_array_equal(row["loss_mask"], expected)
        np.testing.assert_array_equal(row["targets"][real], row["inputs"][real] + 1)  # next token of its document
        targets += int(real.sum())
    assert 0 < sum(r["loss_mask"].sum() for r in rows) < targets  # masked and unmasked targets both occurred


def test_chat_rows_with_every_token_supervised_equal_text_rows():
    docs, _ = chat_docs(40, 50, seed=1)
    ones = [np.stack([d[0], np.ones_like(d[0])]) for d in docs]
    text = [d[0] for d in docs]
    rows = {}
    for name, source in (("chat", ones), ("text", text)):
        packer = packing.RowPacker(lanes.LaneStream([ListSource(source)], [1.0], [9], 1, 3, seq_len=12),
                                   seq_len=12, num_bins=3, pad_id=0)
        rows[name] = [packer.next_row() for _ in range(30)]
    for a, b in zip(rows["chat"], rows["text"]):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("seq_len", [3, 8, 17])
def test_fitted_completion_lengths_equal_one_token_at_a_time(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(0, 12, size=(400, 3))
    kept_c, kept_r = preference_rows.fitted_completion_lengths(*lengths.T, seq_len)
    reference = np.array([reference_fit(*map(int, x), seq_len) for x in lengths])
    np.testing.assert_array_equal(np.stack([kept_c, kept_r], 1), reference)
    counts = preference_rows.fit_statistics(lengths, seq_len)
    kept = reference[:, 0] > 0
    assert counts == {"pairs": 400, "dropped": int((~kept).sum()),
                      "truncated": int((kept & (reference != lengths[:, 1:]).any(1)).sum())}


def test_dpo_rows_decode_back_to_the_pairs_with_truncation_and_drops():
    seq_len = 14
    docs, pairs = preference_docs(80, seed=2, prompt_len=(1, 8))
    stream = lanes.SequentialStream(ListSource(docs), seq_len, PAIRS)
    packer = packing.RowPacker(stream, seq_len, num_bins=3, pad_id=0, row_format=PAIRS)
    rows = list(iter(packer.next_row, None))
    seen = check_pair_rows(rows, pairs, seq_len)
    counts = preference_rows.fit_statistics(np.array([[len(x) for x in pairs[k]] for k in pairs]), seq_len)
    # the data exercise both: some pairs were truncated, some (prompt of 8 > L/2) dropped
    assert counts["truncated"] > 0 and counts["dropped"] > 0
    kept = [k for k, (p, c, r) in pairs.items() if reference_fit(len(p), len(c), len(r), seq_len)[0]]
    assert sorted(seen) == sorted(kept)  # every kept pair once; the dropped ones nowhere
    assert len(kept) == counts["pairs"] - counts["dropped"]
    assert np.mean([r["segment_ids"].astype(bool).mean() for r in rows]) > 0.7  # rows are packed


def packed_rows_iterator(source_lists, row_format, lane_ids, num_lanes, seq_len, weights=None):
    ds = pipeline.PackedRowsDataset(
        sources=[ListSource(d) for d in source_lists], weights=weights or [1.0] * len(source_lists),
        seeds=[11 + i for i in range(len(source_lists))], lane_ids=lane_ids, num_lanes=num_lanes,
        seq_len=seq_len, packing_bins=3, pad_id=0, row_format=row_format)
    return iter(ds)


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def two_kinds():
    chat = [chat_docs(30, 40, seed=3)[0], chat_docs(30, 40, seed=4, start=50_000)[0]]
    pref = [preference_docs(30, seed=5)[0], preference_docs(30, seed=6, start=50_000)[0]]
    return {"chat": (chat, packing.CHUNKS), "preference": (pref, PAIRS)}


@pytest.mark.parametrize("kind", ["chat", "preference"])
def test_lanes_resume_and_split_over_processes(kind):
    source_lists, row_format = two_kinds()[kind]
    whole = packed_rows_iterator(source_lists, row_format, range(4), 4, seq_len=16)
    reference = [next(whole) for _ in range(12)]
    resumed = packed_rows_iterator(source_lists, row_format, range(4), 4, seq_len=16)
    for _ in range(5):
        next(resumed)
    state = json.loads(json.dumps(resumed.get_state()))
    assert [lane["emitted"] for lane in state["lanes"]] == [2] * 4  # saved inside a packing window
    restored = packed_rows_iterator(source_lists, row_format, range(4), 4, seq_len=16)
    restored.set_state(state)
    assert_same(reference[5:], [next(restored) for _ in range(7)])
    halves = [packed_rows_iterator(source_lists, row_format, range(2 * p, 2 * p + 2), 4, seq_len=16) for p in range(2)]
    for batch in reference:
        for p, half in enumerate(halves):
            part = next(half)
            for k in packing.ROW_KEYS:
                np.testing.assert_array_equal(part[k], batch[k][2 * p:2 * p + 2])


def test_dpo_lanes_mix_sources_by_positions_and_keep_pairs_whole():
    (small, large), _ = two_kinds()["preference"]
    pairs = {**preference_docs(30, seed=5)[1], **preference_docs(30, seed=6, start=50_000)[1]}
    it = packed_rows_iterator([small, large], PAIRS, range(2), 2, seq_len=20, weights=[3.0, 1.0])
    positions = {False: 0, True: 0}
    for _ in range(60):
        batch = next(it)
        for r in range(2):
            row = {k: batch[k][r] for k in packing.ROW_KEYS}
            check_pair_rows([row], pairs, 20)
            real = row["segment_ids"] > 0
            for from_large in (False, True):
                positions[from_large] += int((real & ((row["inputs"] >= 50_000) == from_large)).sum())
    assert abs(positions[False] / sum(positions.values()) - 0.75) < 0.03, positions


def prepared(name, kind, docs):
    source = ListSource(docs)
    return sources.PreparedSource(name, f"/{name}", {"kind": kind} if kind else {}, source, source)


def test_sources_of_two_kinds_are_refused_naming_both():
    chat, _ = chat_docs(3, 10, seed=7)
    assert kinds.sources_kind({"a": prepared("a", None, [d[0] for d in chat])}) == "text"  # old manifests
    assert kinds.sources_kind({"a": prepared("a", "chat", chat), "b": prepared("b", "chat", chat)}) == "chat"
    with pytest.raises(ConfigError, match=r"data.sources.a holds chat data but data.sources.b holds preference"):
        kinds.sources_kind({"a": prepared("a", "chat", chat), "b": prepared("b", "preference", chat)})


def test_pair_statistics_per_phase_and_a_phase_that_fits_no_pair(caplog):
    docs, _ = preference_docs(40, seed=8, prompt_len=(3, 6))
    opened = {"pref": prepared("pref", "preference", docs)}
    phase = lambda i, seq_len: curriculum.PhaseInfo(i, f"p{i}", 100, seq_len, 1e4, 2, (("pref", 1.0),))
    lengths = preference_rows.source_part_lengths(ListSource(docs))
    stats = pipeline.pair_statistics([phase(0, 10), phase(1, 64)], opened)
    assert stats == {"p0": {"pref": preference_rows.fit_statistics(lengths, 10)},
                     "p1": {"pref": {"pairs": 40, "truncated": 0, "dropped": 0}}}
    assert stats["p0"]["pref"]["truncated"] > 0 and stats["p0"]["pref"]["dropped"] > 0
    warned = [r.getMessage() for r in caplog.records if "pairs of data.sources.pref" in r.getMessage()]
    assert len(warned) == 1 and "phase p0 (seq_len=10)" in warned[0]  # p1 truncates nothing: no warning
    with pytest.raises(ConfigError, match=r"data.phases\[1\].seq_len=5 fits no pair of data.sources.pref"):
        pipeline.pair_statistics([phase(0, 10), phase(1, 5)], opened)


# End to end: prepared chat / preference datasets (prepare.write_tokenized) through build_pipeline
# and build_eval_batches.

TOKENIZER = {"sha256": "synthetic", "vocab_size": 65536, "bos_id": 2, "eos_id": 1, "pad_id": 0}
DOCS = 60
HELDOUT = 0.1  # the last 6 documents of each source


def posttrain_config(paths, seq_len, batch=4, batches=6, eval_seq_len=None):
    phase = ml_collections.ConfigDict(dict(name="post", token_budget=batches * batch * seq_len, seq_len=seq_len,
                                           rope_theta=1e4, global_batch_size=batch,
                                           weights={n: 1.0 for n in paths}))
    return ml_collections.ConfigDict(dict(
        sources=dict(paths), tokenizer="unused", phases=(phase,), pad_id=0, heldout_fraction=HELDOUT,
        packing_bins=3, worker_count=0, worker_buffer_size=1, prefetch_buffer_size=0,
        eval=dict(seq_len=eval_seq_len or seq_len, batch_size=2, max_batches=0)))


@pytest.fixture(scope="module")
def prepared_dirs(tmp_path_factory):
    """{name: (dir, documents as written)}: chat sources c1, c2 and preference sources p1, p2."""
    root, result = tmp_path_factory.mktemp("posttrain"), {}
    for name, start in (("c1", 1), ("c2", 30_000)):
        docs, _ = chat_docs(DOCS, 40, seed=start, start=start)
        written = [(d[0], d[1].astype(np.uint8)) for d in docs]
        prepare.write_tokenized(str(root / name), written, tokenizer_info=TOKENIZER, num_shards=2, kind="chat")
        result[name] = (str(root / name), docs)
    for name, start in (("p1", 1), ("p2", 30_000)):
        docs, pairs = preference_docs(DOCS, seed=start, start=start, prompt_len=(1, 9))
        written = [tuple(pairs[int(d[0][0])]) for d in docs]
        prepare.write_tokenized(str(root / name), written, tokenizer_info=TOKENIZER, num_shards=2, kind="preference")
        result[name] = (str(root / name), docs)
    return result


def draw(it, n):
    return [next(it) for _ in range(n)]


def rows_of(batches):
    return [{k: b[k][r] for k in packing.ROW_KEYS} for b in batches for r in range(b["inputs"].shape[0])]


@pytest.mark.parametrize("kind", ["chat", "preference"])
def test_prepared_sources_pipeline_resume_processes_and_eval(prepared_dirs, kind):
    names = ("c1", "c2") if kind == "chat" else ("p1", "p2")
    config = posttrain_config({n: prepared_dirs[n][0] for n in names}, seq_len=16)
    split = DOCS - round(DOCS * HELDOUT)
    train_docs = [d for n in names for d in prepared_dirs[n][1][:split]]
    heldout_docs = {n: prepared_dirs[n][1][split:] for n in names}
    pipe = build_pipeline(config, seed=2)
    assert pipe.kind == kind
    batches = draw(pipe, 6)
    if kind == "chat":
        assert pipe.statistics == {}
        mask_of = {int(t): int(m) for d in train_docs for t, m in zip(*d)}
        for row in rows_of(batches):
            real = row["segment_ids"] > 0
            expected = [mask_of[int(t)] if r else 0 for t, r in zip(row["targets"], real)]
            np.testing.assert_array_equal(row["loss_mask"], expected)
    else:
        pairs = {int(d[0][0]): tuple(d[0][d[1] == part] for part in range(3)) for d in train_docs}
        stats = pipe.statistics["post"]
        for n in names:
            lengths = np.array([[int((d[1] == part).sum()) for part in range(3)]
                                for d in prepared_dirs[n][1][:split]])
            reference = np.array([reference_fit(*x, 16) for x in lengths])
            assert stats[n] == {"pairs": split, "dropped": int((reference[:, 0] == 0).sum()),
                                "truncated": int(((reference[:, 0] > 0) & (reference != lengths[:, 1:]).any(1)).sum())}
            assert stats[n]["truncated"] > 0 and stats[n]["dropped"] > 0
        assert len(check_pair_rows(rows_of(batches), pairs, 16)) > 20
    # resume from a JSON round trip of the state, mid-phase
    resumed = build_pipeline(config, seed=2)
    draw(resumed, 2)
    state = json.loads(json.dumps(resumed.get_state()))
    restored = build_pipeline(config, seed=2)
    restored.set_state(state)
    assert_same(rows_of(batches[2:]), rows_of(draw(restored, 4)))
    # process p of 2 gets rows [2p, 2p+2) of the one-process batch
    for p in range(2):
        part = draw(build_pipeline(config, seed=2, process_index=p, process_count=2), 6)
        assert_same(rows_of([{k: b[k][2 * p:2 * p + 2] for k in b} for b in batches]), rows_of(part))
    # held-out batches: every supervised target / every kept pair, once
    evals = build_eval_batches(config)
    halves = [build_eval_batches(config, process_index=p, process_count=2) for p in range(2)]
    for n in names:
        assert all(b["inputs"].shape == (2, 16) for b in evals[n])
        assert_same(rows_of(evals[n]), [r for i in range(len(evals[n])) for p in range(2)
                                         for r in rows_of([halves[p][n][i]])])
        if kind == "chat":
            got = sorted(int(t) for b in evals[n] for t in b["targets"][b["loss_mask"] > 0])
            assert got == sorted(int(t) for d in heldout_docs[n] for t, m in zip(*d[:, 1:]) if m)
        else:
            pairs = {int(d[0][0]): tuple(d[0][d[1] == part] for part in range(3)) for d in heldout_docs[n]}
            kept = [k for k, (a, b, c) in pairs.items() if reference_fit(len(a), len(b), len(c), 16)[0]]
            assert sorted(check_pair_rows(rows_of(evals[n]), pairs, 16)) == sorted(kept)


def test_pipeline_refuses_sources_of_two_kinds(prepared_dirs):
    config = posttrain_config({n: prepared_dirs[n][0] for n in ("c1", "p1")}, seq_len=16)
    with pytest.raises(ConfigError, match=r"data.sources.c1 holds chat data but data.sources.p1 holds preference"):
        build_pipeline(config)
    with pytest.raises(ConfigError, match=r"data.sources.c1 holds chat data but data.sources.p1 holds preference"):
        build_eval_batches(config)

"""Chunking, first-fit packing, row format and the lane streams (no files involved)."""

import collections
import json

import numpy as np
import pytest

from zaya_jax.data import lanes, packing


class ListStream:
    """A finite chunk stream over given chunks (what SequentialStream is, minus the files)."""

    def __init__(self, chunks):
        self.chunks, self.pos = chunks, 0

    def next_chunk(self):
        if self.pos == len(self.chunks):
            return None
        self.pos += 1
        return self.chunks[self.pos - 1]

    def get_state(self):
        return self.pos

    def set_state(self, state):
        self.pos = state


class ListSource:
    """A DocumentSource stand-in: a list of int32 documents."""

    def __init__(self, docs):
        self.docs = [np.asarray(d, np.int32) for d in docs]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def unique_docs(num_docs, max_len, seed=0, start=1):
    """Documents whose token ids are unique and consecutive (id -> its document and position)."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], start
    for n in rng.integers(2, max_len + 1, num_docs):
        docs.append(np.arange(next_id, next_id + n, dtype=np.int32))
        next_id += n
    return docs


def check_row(row, seq_len, pad_id=0):
    """Every segment is a consecutive run of one document with its next tokens as targets."""
    seg, pos = row["segment_ids"], row["positions"]
    n_real = int((seg > 0).sum())
    assert np.all(seg[:n_real] > 0) and np.all(seg[n_real:] == 0), "padding only at the end"
    assert np.all(np.diff(seg[:n_real]) >= 0) and np.all(np.diff(seg[:n_real]) <= 1)
    for s in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == s)
        assert np.array_equal(pos[idx], np.arange(len(idx)))
        assert np.array_equal(row["targets"][idx], row["inputs"][idx] + 1)
    pad = seg == 0
    assert np.all(row["inputs"][pad] == pad_id) and np.all(row["targets"][pad] == pad_id)
    assert np.all(pos[pad] == 0)
    np.testing.assert_array_equal(row["loss_mask"], (seg > 0).astype(np.float32))
    assert row["loss_mask"].dtype == np.float32 and row["inputs"].dtype == np.int32
    assert all(row[k].shape == (seq_len,) for k in packing.ROW_KEYS)


@pytest.mark.parametrize("n,seq_len", [(2, 4), (5, 4), (6, 4), (9, 4), (10, 4), (100, 7)])
def test_chunk_bounds_cover_every_target_once(n, seq_len):
    bounds = packing.chunk_bounds(n, seq_len)
    assert all(2 <= e - s <= seq_len + 1 for s, e in bounds)
    targets = [t for s, e in bounds for t in range(s + 1, e)]
    assert targets == list(range(1, n))
    assert all(b[0] == a[1] - 1 for a, b in zip(bounds, bounds[1:]))  # overlap by one token


def test_make_row_layout():
    row = packing.make_row([np.array([5, 6, 7]), np.array([9, 10])], seq_len=6, pad_id=0)
    np.testing.assert_array_equal(row["inputs"], [5, 6, 9, 0, 0, 0])
    np.testing.assert_array_equal(row["targets"], [6, 7, 10, 0, 0, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(row["loss_mask"], [1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="seq_len"):
        packing.make_row([np.arange(8)], seq_len=6, pad_id=0)


def test_packer_loses_and_duplicates_nothing():
    seq_len = 16
    docs = unique_docs(200, 50)
    chunks = [d[s:e] for d in docs for s, e in packing.chunk_bounds(len(d), seq_len)]
    packer = packing.RowPacker(ListStream(chunks), seq_len, num_bins=4, pad_id=0)
    rows = list(iter(packer.next_row, None))
    for row in rows:
        check_row(row, seq_len)
    seen = collections.Counter(t for r in rows for t in r["targets"][r["segment_ids"] > 0])
    expected = collections.Counter(t for d in docs for t in d[1:])
    assert seen == expected  # every target exactly once
    fill = np.mean([r["loss_mask"].mean() for r in rows])
    assert fill > 0.85, fill


def test_packer_state_restores_mid_window():
    seq_len, docs = 16, unique_docs(100, 40, seed=1)
    chunks = [d[s:e] for d in docs for s, e in packing.chunk_bounds(len(d), seq_len)]
    packer = packing.RowPacker(ListStream(chunks), seq_len, num_bins=4, pad_id=0)
    for _ in range(6):  # 1.5 windows
        packer.next_row()
    state = packer.get_state()
    assert state["emitted"] == 2
    expected = [packer.next_row() for _ in range(7)]
    restored = packing.RowPacker(ListStream(chunks), seq_len, num_bins=4, pad_id=0)
    restored.set_state(state)
    for a, b in zip(expected, [restored.next_row() for _ in range(7)]):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(a[k], b[k])


def test_lanes_split_each_epoch_without_overlap():
    docs = unique_docs(37, 10, seed=2)
    source, num_lanes = ListSource(docs), 4
    streams = [lanes.LaneStream([source], [1.0], [123], lane, num_lanes, seq_len=64) for lane in range(num_lanes)]
    firsts = []
    for lane, stream in enumerate(streams):
        # lane r draws global draws r, r+4, ...: its share of the first epoch of 37 documents
        for _ in range(len(range(lane, len(docs), num_lanes))):
            firsts.append(int(stream.next_chunk()[0]))
    starts = sorted(int(d[0]) for d in docs)
    assert sorted(firsts) == starts  # every document once across the lanes
    one_lane = lanes.LaneStream([source], [1.0], [123], 0, 1, seq_len=64)
    epoch1 = [int(one_lane.next_chunk()[0]) for _ in docs]
    epoch2 = [int(one_lane.next_chunk()[0]) for _ in docs]
    assert sorted(epoch1) == sorted(epoch2) == starts and epoch1 != epoch2  # fresh permutation per epoch


def test_lane_mixture_follows_token_weights():
    big = ListSource(unique_docs(50, 30, seed=3, start=1))
    small = ListSource(unique_docs(50, 30, seed=4, start=20_000))
    stream = lanes.LaneStream([big, small], [3.0, 1.0], [1, 2], 0, 1, seq_len=64)
    tokens = collections.Counter()
    for _ in range(2000):
        chunk = stream.next_chunk()
        tokens[chunk[0] >= 20_000] += len(chunk) - 1
    assert abs(tokens[False] / sum(tokens.values()) - 0.75) < 0.01


def test_lane_state_roundtrip():
    source = ListSource(unique_docs(20, 100, seed=5))
    stream = lanes.LaneStream([source], [1.0], [7], 2, 3, seq_len=16)
    for _ in range(11):
        stream.next_chunk()
    state = stream.get_state()
    expected = [stream.next_chunk() for _ in range(9)]
    other = lanes.LaneStream([source], [1.0], [7], 2, 3, seq_len=16)
    other.set_state(state)
    for a, b in zip(expected, [other.next_chunk() for _ in range(9)]):
        np.testing.assert_array_equal(a, b)


def test_lane_state_roundtrip_keeps_the_mixture_where_it_was():
    """With two sources the resumed lane must pick sources by the token counts so far (a lane that
    forgot them would start the weights' deficit over and draw other documents); the state goes
    through JSON, as the checkpoint stores it."""
    big = ListSource(unique_docs(60, 30, seed=3, start=1))
    small = ListSource(unique_docs(60, 30, seed=4, start=20_000))
    make = lambda: lanes.LaneStream([big, small], [3.0, 1.0], [1, 2], 1, 2, seq_len=16)  # noqa: E731
    stream = make()
    for _ in range(37):
        stream.next_chunk()
    state = json.loads(json.dumps(stream.get_state()))
    expected = [stream.next_chunk() for _ in range(60)]
    other = make()
    other.set_state(state)
    for a, b in zip(expected, [other.next_chunk() for _ in range(60)]):
        np.testing.assert_array_equal(a, b)


def test_sequential_stream_reads_every_chunk_once():
    docs = unique_docs(30, 40, seed=6)
    stream = lanes.SequentialStream(ListSource(docs), seq_len=8)
    chunks = []
    while (chunk := stream.next_chunk()) is not None:
        chunks.append(chunk)
    assert [t for c in chunks for t in c[1:]] == [t for d in docs for t in d[1:]]


def test_mix_seed_is_stable():
    assert lanes.mix_seed(0, 1, 2) == lanes.mix_seed(0, 1, 2) != lanes.mix_seed(0, 2, 1)
    assert 0 <= lanes.mix_seed(2**70, -5) < 2**31


@pytest.mark.parametrize("size", [1, 2, 3, 10, 64, 65, 1000])
def test_permute_index_is_a_seeded_bijection(size):
    perm = [lanes.permute_index(i, size, seed=11) for i in range(size)]
    assert sorted(perm) == list(range(size))
    assert perm == [lanes.permute_index(i, size, seed=11) for i in range(size)]
    if size >= 10:
        assert perm != [lanes.permute_index(i, size, seed=12) for i in range(size)] != list(range(size))

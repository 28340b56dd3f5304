"""The training input pipeline: curriculum phases of packed, mixed batches, built on Grain.

Per phase (B = global batch, n = process_count, W = worker_count, L = seq_len):

  PackedRowsDataset   lanes [p*B/n, (p+1)*B/n): each a LaneStream (seeded shuffle per source,
                      token-weighted mixture, chunking or whole pairs) feeding a RowPacker
                      (first-fit packing)
  .mp_prefetch(W)     worker w computes lanes w, w+W, ... (set_slice), so workers split the
                      work without changing a single row
  _MergeWorkersDataset  puts the W workers' rows back in lane order
  ThreadPrefetch      a main-process prefetch thread

Batch (numpy; each [B/n, L]): inputs, targets, segment_ids, positions int32; loss_mask
float32. The sources' kind (kinds.py) picks the rows: text -> pretraining rows and chat -> SFT
rows (packing.py), preference -> DPO rows (preference_rows.py). Because row r of every global
batch comes from lane r,
the batches do not depend on n or W: process p's batch is rows [p*B/n, (p+1)*B/n) of the
batch one process would build.

`DataPipeline` chains the phases: it moves on once a phase has delivered
ceil(token_budget / (B*L)) global batches, reports the phase of each batch (`.phase`), and is
a grain DatasetIterator whose JSON-able state (phase index, batches into it, the phase
iterator's state) works with grain.checkpoint.CheckpointSave / CheckpointRestore.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging
import grain
import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data import curriculum, kinds, lanes, packing, preference_rows, sources as sources_lib
from zaya_jax.data.curriculum import PhaseInfo

STATE_VERSION = 1


class PackedRowsDataset(grain.IterDataset):
    """Element k: row k of each of `lanes`, stacked: dict of [len(lanes), L] arrays."""

    def __init__(self, sources: Sequence[sources_lib.DocumentSource], weights: Sequence[float],
                 seeds: Sequence[int], lane_ids: range, num_lanes: int, seq_len: int, packing_bins: int,
                 pad_id: int, row_format: packing.RowFormat = packing.CHUNKS):
        super().__init__()
        self.sources, self.weights, self.seeds = list(sources), list(weights), list(seeds)
        self.lane_ids, self.num_lanes, self.seq_len = lane_ids, num_lanes, seq_len
        self.packing_bins, self.pad_id, self.row_format = packing_bins, pad_id, row_format

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by mp_prefetch in worker w with slice(w, None, W): keep lanes w, w+W, ..."""
        del sequential_slice
        self.lane_ids = self.lane_ids[sl]

    def __iter__(self) -> grain.DatasetIterator:
        return _PackedRowsIterator(self)

    def __str__(self) -> str:
        return f"PackedRowsDataset(lanes={self.lane_ids}, seq_len={self.seq_len})"


class _PackedRowsIterator(grain.DatasetIterator):

    def __init__(self, ds: PackedRowsDataset):
        super().__init__()
        self._packers = [
            packing.RowPacker(lanes.LaneStream(ds.sources, ds.weights, ds.seeds, lane, ds.num_lanes, ds.seq_len,
                                               ds.row_format),
                              ds.seq_len, ds.packing_bins, ds.pad_id, ds.row_format) for lane in ds.lane_ids]

    def __next__(self) -> dict[str, np.ndarray]:
        return packing.stack_rows([p.next_row() for p in self._packers])

    def get_state(self) -> dict[str, Any]:
        return {"lanes": [p.get_state() for p in self._packers]}

    def set_state(self, state: dict[str, Any]) -> None:
        if len(state["lanes"]) != len(self._packers):
            raise ValueError(f"state has {len(state['lanes'])} lanes, this iterator {len(self._packers)}")
        for packer, lane_state in zip(self._packers, state["lanes"]):
            packer.set_state(lane_state)


class _MergeWorkersDataset(grain.IterDataset):
    """Merges W consecutive elements (worker w: lanes w, w+W, ...) into one in lane order."""

    def __init__(self, parent: grain.IterDataset, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __iter__(self) -> grain.DatasetIterator:
        return _MergeWorkersIterator(self._parent.__iter__(), self._num_workers)


class _MergeWorkersIterator(grain.DatasetIterator):

    def __init__(self, parent: grain.DatasetIterator, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(self._parent) for _ in range(self._num_workers)]
        # parts[w] row q is lane q*W + w: stacking on axis 1 gives [Q, W, L] -> [Q*W, L].
        return {k: np.stack([p[k] for p in parts], axis=1).reshape(-1, parts[0][k].shape[-1]) for k in parts[0]}

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()  # always consumed in whole groups of W

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)


def phase_dataset(phase: PhaseInfo, sources: Mapping[str, sources_lib.PreparedSource], data_config, *,
                  seed: int, process_index: int, process_count: int, kind: str = "text",
                  image_rows: packing.RowFormat | None = None) -> grain.IterDataset:
    """This process's batches of one phase (an endless Grain IterDataset) of `kind` rows
    (image_chat: `image_rows`, kinds.row_format)."""
    names = [name for name, _ in phase.weights]
    rows = phase.global_batch_size // process_count
    ds = PackedRowsDataset(
        sources=[sources[n].train for n in names], weights=[w for _, w in phase.weights],
        seeds=[lanes.mix_seed(seed, phase.index, zlib.crc32(n.encode())) for n in names],
        lane_ids=range(process_index * rows, (process_index + 1) * rows), num_lanes=phase.global_batch_size,
        seq_len=phase.seq_len, packing_bins=data_config.packing_bins, pad_id=data_config.pad_id,
        row_format=kinds.row_format(kind, image_rows))
    workers = data_config.worker_count
    if workers:
        buffer = max(1, data_config.worker_buffer_size)
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer))
    if workers > 1:
        ds = _MergeWorkersDataset(ds, workers)
    if data_config.prefetch_buffer_size:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_config.prefetch_buffer_size)
    return ds


def _close_iterator(holder: list[grain.DatasetIterator]) -> None:
    holder.pop().close()


def foreign_state(state: dict[str, Any], kind: str) -> str:
    """A state_problem: `state` is not one a `kind` iterator saves."""
    return f"is not a {kind}'s (it holds {', '.join(sorted(state)) or 'nothing'})"


class DataPipeline(grain.DatasetIterator):
    """Batches through the curriculum; `next(pipeline)` -> dict of numpy [B/n, L_phase] arrays.

    Attributes:
      phases: every PhaseInfo, in order (e.g. to compile each phase's step ahead of time).
      phase: the PhaseInfo of the batch returned last (before the first: of the next batch).
      vocab_size: the vocabulary the sources were tokenized with.
      kind: the sources' kind: 'text' (pretraining rows), 'chat' (SFT rows) or 'preference'
        (DPO rows of whole pairs).
      statistics: preference: {phase name: {source: {"pairs", "truncated", "dropped"}}}, how many
        pairs of each source's training split the phase's seq_len truncates or drops (see
        preference_rows.py; independent of processes, counted once per pair, not per epoch; also
        logged as a warning when the pipeline is built); text and chat: {}.
      chat_template: the chat template the sources were prepared with, as
        ChatTemplate.record() (sources.chat_template_of); None for text sources.
    Raises StopIteration once the last phase's budget is spent. Call close() when done (it stops
    worker processes).
    """

    def __init__(self, phases: Sequence[PhaseInfo], make_phase: Callable[[PhaseInfo], grain.IterDataset],
                 layout: dict[str, Any], vocab_size: int, *, kind: str = "text",
                 statistics: dict[str, Any] | None = None, chat_template: dict | None = None):
        super().__init__()
        self.phases, self.vocab_size = tuple(phases), vocab_size
        self.kind, self.statistics, self.chat_template = kind, statistics or {}, chat_template
        self._make_phase, self._layout = make_phase, layout
        self._index, self._batches, self._returned = 0, 0, 0
        self._iter: list[grain.DatasetIterator] = []  # the current phase's iterator, once made

    @property
    def phase(self) -> PhaseInfo:
        return self.phases[self._returned]

    def _phase_iterator(self) -> grain.DatasetIterator:
        if not self._iter:
            self._iter.append(iter(self._make_phase(self.phases[self._index])))
            # Also closed at exit, while the interpreter can still stop its workers and threads.
            self._finalizer = weakref.finalize(self, _close_iterator, self._iter)
        return self._iter[0]

    def _close_phase(self) -> None:
        if self._iter:
            self._finalizer()

    def __next__(self) -> dict[str, np.ndarray]:
        while self._batches >= self.phases[self._index].num_batches:
            if self._index == len(self.phases) - 1:
                raise StopIteration
            self._close_phase()
            self._index, self._batches = self._index + 1, 0
        batch = next(self._phase_iterator())
        self._batches += 1
        self._returned = self._index
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "layout": self._layout, "phase_index": self._index,
                "batches_in_phase": self._batches, "returned_phase": self._returned,
                "phase_state": self._iter[0].get_state() if self._iter else None}

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """Why this pipeline cannot continue from `state` (a saved get_state()), or None: a state of
        another iterator, or of a pipeline with another layout (phases, processes, seed, workers)."""
        if "layout" not in state:
            return foreign_state(state, "data pipeline")
        if state.get("version") != STATE_VERSION:
            return f"is of format {state.get('version')}, this pipeline's is {STATE_VERSION}"
        for key, value in self._layout.items():
            if state["layout"].get(key) != value:
                return f"was saved by a different pipeline ({key} {state['layout'].get(key)} there, {value} here)"
        return None

    def set_state(self, state: dict[str, Any]) -> None:
        problem = self.state_problem(state)
        if problem:
            raise ValueError(f"data iterator state {problem}")
        self._close_phase()
        self._index, self._batches = state["phase_index"], state["batches_in_phase"]
        self._returned = state["returned_phase"]
        if state["phase_state"] is not None:
            self._phase_iterator().set_state(state["phase_state"])

    def start_prefetch(self) -> None:
        self._phase_iterator().start_prefetch()

    def close(self) -> None:
        self._close_phase()


def pair_statistics(phases: Sequence[PhaseInfo],
                    sources: Mapping[str, sources_lib.PreparedSource]) -> dict[str, dict[str, dict[str, int]]]:
    """{phase name: {source: {"pairs", "truncated", "dropped"}}} of preference sources' training
    splits (reads every pair once); logs a warning for each source a phase truncates or drops
    pairs of. ConfigError if a phase's seq_len drops every pair of a source."""
    lengths = {name: preference_rows.source_part_lengths(source.train) for name, source in sources.items()}
    result = {}
    for phase in phases:
        result[phase.name] = {name: preference_rows.fit_statistics(lengths[name], phase.seq_len)
                              for name, _ in phase.weights}
        for name, counts in result[phase.name].items():
            if counts["dropped"] == counts["pairs"]:
                raise ConfigError(f"data.phases[{phase.index}].seq_len={phase.seq_len} fits no pair of "
                                  f"data.sources.{name} (a pair needs twice its prompt's tokens plus one token "
                                  f"of each completion): raise seq_len or shorten the prompts")
            if counts["truncated"] or counts["dropped"]:
                logging.warning("phase %s (seq_len=%d), pairs of data.sources.%s: %s", phase.name, phase.seq_len,
                                name, counts)
    return result


def build_pipeline(data_config, *, global_batch_size: int | None = None, process_index: int = 0,
                   process_count: int = 1, seed: int = 0, image_rows: packing.RowFormat | None = None
                   ) -> DataPipeline:
    """The curriculum pipeline of `data_config` (see curriculum.py) for one process.

    Validates the config first (ValueError naming the field), then opens the sources the phases
    use (FileNotFoundError / ValueError naming the source and path; builds the demo corpus on
    first use) and checks they are of one kind (ConfigError naming two that differ); preference
    sources are read once for `DataPipeline.statistics`. `global_batch_size` replaces every
    phase's B. `image_rows`: the rows of image_chat sources (a vision model's, kinds.row_format).
    """
    phases = curriculum.parse_phases(data_config, global_batch_size=global_batch_size, process_count=process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    used = sorted({name for p in phases for name, _ in p.weights})
    opened = sources_lib.open_sources(data_config, used)
    kind = kinds.sources_kind(opened)
    kinds.row_format(kind, image_rows)  # image_chat data without a vision model fails here, before any batch
    statistics = pair_statistics(phases, opened) if kind == "preference" else {}
    make_phase = functools.partial(phase_dataset, sources=opened, data_config=data_config, seed=seed,
                                   process_index=process_index, process_count=process_count, kind=kind,
                                   image_rows=image_rows)
    # A state restores only into the same layout (grain's worker state has one entry per worker).
    layout = {"process_index": process_index, "process_count": process_count, "seed": seed,
              "worker_count": data_config.worker_count, "packing_bins": data_config.packing_bins,
              "phases": [[p.name, p.global_batch_size, p.seq_len] for p in phases]}
    return DataPipeline(phases, make_phase, layout, sources_lib.vocab_size(opened), kind=kind,
                        statistics=statistics, chat_template=sources_lib.chat_template_of(opened))

"""Held-out evaluation batches, per source.

Each source's held-out split (the last `data.heldout_fraction` of its documents) is read once,
in order, cut and packed exactly like training rows of its kind (kinds.py: text and chat
documents chunked, chat rows masked to assistant targets; preference documents as whole fitted
pairs), and cut into global batches of `batch_size` rows; the last batch is filled up with empty
rows (loss_mask 0), so summing loss * loss_mask over the list covers every held-out target
exactly once (for preference: of every pair kept, truncated as in training).
"""

from __future__ import annotations

from absl import logging
import numpy as np

from zaya_jax.data import curriculum, kinds, lanes, packing, preference_rows, sources as sources_lib


def build_eval_batches(data_config, *, seq_len: int | None = None, batch_size: int | None = None,
                       max_batches: int | None = None, process_index: int = 0,
                       process_count: int = 1, image_rows: packing.RowFormat | None = None
                       ) -> dict[str, list[dict[str, np.ndarray]]]:
    """{source: [batch, ...]}; each batch a dict of [batch_size / process_count, L] numpy arrays.

    Defaults come from `data_config.eval` (seq_len, batch_size, max_batches; max_batches 0 or
    None: the whole held-out split). Process p gets rows [p*B/n, (p+1)*B/n) of every batch.
    The sources must be of one kind (ConfigError naming two that differ); held-out preference
    pairs that seq_len truncates or drops are counted in a logged warning.
    """
    curriculum.parse_phases(data_config, process_count=process_count)
    seq_len = seq_len or data_config.eval.seq_len
    batch_size = batch_size or data_config.eval.batch_size
    max_batches = data_config.eval.max_batches if max_batches is None else max_batches
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"data.eval.{name} must be a positive integer, got {value!r}")
    if batch_size % process_count or not 0 <= process_index < process_count:
        raise ValueError(f"eval batch_size={batch_size} must split evenly over {process_count} processes "
                         f"and process_index={process_index} must be below that")
    rows_per_process = batch_size // process_count
    mine = slice(process_index * rows_per_process, (process_index + 1) * rows_per_process)
    opened = sources_lib.open_sources(data_config)
    row_format = kinds.row_format(kinds.sources_kind(opened), image_rows)
    empty = row_format.make_row([], seq_len, data_config.pad_id)
    result = {}
    for name, source in opened.items():
        if row_format is preference_rows.PAIRS:
            counts = preference_rows.fit_statistics(preference_rows.source_part_lengths(source.heldout), seq_len)
            if counts["truncated"] or counts["dropped"]:
                logging.warning("held-out pairs of data.sources.%s at seq_len=%d: %s", name, seq_len, counts)
        packer = packing.RowPacker(lanes.SequentialStream(source.heldout, seq_len, row_format), seq_len,
                                   data_config.packing_bins, data_config.pad_id, row_format)
        batches, rows, done = [], [], False
        while not done and not (max_batches and len(batches) == max_batches):
            row = packer.next_row()
            done = row is None
            if not done:
                rows.append(row)
            if rows and (len(rows) == batch_size or done):
                rows += [empty] * (batch_size - len(rows))
                batches.append(packing.stack_rows(rows[mine]))
                rows = []
        result[name] = batches
    return result

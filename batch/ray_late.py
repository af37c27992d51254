"""Late chunking on Ray (`batch embed --ray --late-chunking`): documents stay whole.

A document's chunks must reach one actor call together, in order, but Ray Data cuts blocks
(its streaming repartition, `map_batches`' batch size) at arbitrary rows. So the read task
groups rows into the local job's windows first (`batch.windows.late_groups`: whole
documents, cut at the first document boundary at or past the window's row count, a document
longer than that kept whole) and ships each window as ONE Arrow row, which no repartition can
cut. The actor plans the window (`plan_late_window`), embeds it and pools each document's
chunks exactly as the local job does (`batch.job._Progress`, `late_results`), and returns one
row per embedded chunk or error record. Every row of a window carries its block's
`block_rows` (the window's output rows), `block_next_line` (where the input continues: the
next document's first row, so a resume never starts inside a document), `block_tokens` (the
tokens read) and, for an error row, its whole record as JSON (a document's record stands for
all its rows): batch/ray_commit.py commits the window with them as the local job commits it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pyarrow as pa

from batch.embedder import LaneEmbedder
from batch.job import LateResults, _Progress, late_results
from batch.rows import InputSpec
from batch.windows import LateGroup, Window, late_groups, plan_late_window
from host.admission import Budgets
from host.module import ModuleConfig

LATE_READ_SCHEMA = pa.schema([("window", pa.binary()), ("block", pa.int64())])


def read_late_blocks(
    spec: InputSpec, stripe: int, stripes: int, window_rows: int, start_line: int, budgets: Budgets
) -> Iterator[pa.Table]:
    """Stripe `stripe` of the late-chunking windows from `start_line`, one row each: the
    window's rows (msgpack) and its block number (windows numbered from 0 at `start_line`)."""
    for block, group in enumerate(late_groups(spec, start_line, window_rows, budgets)):
        if block % stripes == stripe:
            yield pa.table(
                {"window": [msgspec.msgpack.encode(group)], "block": [block]},
                schema=LATE_READ_SCHEMA,
            )


def embed_late(
    batch: pa.Table,
    emb: LaneEmbedder,
    config: ModuleConfig,
    normalize: bool,
    meta: str,
    run: Callable,
) -> pa.Table:
    """The actor's call on late-chunking windows: each planned, embedded (its forward windows
    batched as the local job batches them) and pooled. `run` runs a coroutine on the actor's
    loop."""
    assert emb.tokenizer is not None  # set when the embedder started
    tables = []
    for blob, block in zip(
        batch.column("window").to_pylist(), batch.column("block").to_pylist(), strict=True
    ):
        window = plan_late_window(
            block,
            msgspec.msgpack.decode(blob, type=LateGroup),
            emb.tokenizer,
            config.max_worker_batch_tokens,
            config.max_batch_items,
            config.budgets,
            emb.prompt,
        )
        state = _Progress(window, emb.dims)
        for group in window.batches:
            result = run(emb.embed([window.ids[i] for i in group]))
            for j, i in enumerate(group):
                if j in result.failed:
                    state.crashed[i] = result.failed[j]
                else:
                    state.put(i, result.vectors[j])  # pooled now: the states are dropped
        tables.append(_late_table(late_results(state, normalize), window, block, meta, emb.dims))
    return pa.concat_tables(tables)


def _late_table(done: LateResults, window: Window, block: int, meta: str, dims: int) -> pa.Table:
    errors = done.errors
    n = len(done.rows) + len(errors)
    vectors = np.zeros((n, dims), np.float32)
    vectors[: len(done.rows)] = done.vectors
    none = [None] * len(done.rows)
    table = pa.table(
        {
            "line": pa.array([r.line for r in done.rows] + [e["line"] for e in errors], pa.int64()),
            "id": pa.array([r.id for r in done.rows] + [e["id"] for e in errors], pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dims),
            "n_tokens": pa.array(done.n_tokens + [0] * len(errors), pa.int32()),
            "truncated": pa.array([False] * n, pa.bool_()),
            "error_code": pa.array(none + [e["error"]["code"] for e in errors], pa.string()),
            "error_message": pa.array(none + [e["error"]["message"] for e in errors], pa.string()),
            "error_record": pa.array(none + [json.dumps(e) for e in errors], pa.string()),
            "_meta": pa.array([meta] * n, pa.string()),
            "block": pa.array([block] * n, pa.int64()),
            "block_rows": pa.array([n] * n, pa.int64()),
            "block_next_line": pa.array([window.next_line] * n, pa.int64()),
            "block_tokens": pa.array([done.tokens] * n, pa.int64()),
        }
    )
    return table.sort_by("line")

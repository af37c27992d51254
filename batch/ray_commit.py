"""The Ray job's committer: actor results, in any order, into the local job's checkpoint.

Every row the actors return carries its read block (`block`, numbered from 0 at the line the
run started at) and the block's row count (`block_rows`). The actors finish blocks in any
order and a block may come back in pieces; a block is committed — one part file, its error
records, `state.json` (batch/checkpoint.py) — once all its rows are in and every block
before it is committed. So the checkpoint is always a prefix of the input, exactly as the
local job leaves it, and `--resume` (on Ray or locally) continues at its `next_line`. Blocks
that finished ahead of the one being waited for are held here, on the driver. A
late-chunking block (one window of whole documents, batch/ray_late.py) also carries its
error records whole, the tokens it read and the line the input continues at.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batch.checkpoint import Checkpoint
from batch.dtypes import convert
from batch.errors import JobAborted
from batch.job import (
    JobOptions,
    _full_disk_aborts,
    _raise_if_over_max_errors,
    _resume_advice,
    _schema,
)
from batch.output import make_table


class BlockCommitter:
    def __init__(
        self,
        ckpt: Checkpoint,
        opts: JobOptions,
        ranges: np.ndarray | None = None,
        on_commit: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.ckpt, self.opts, self.ranges = ckpt, opts, ranges
        self.on_commit = on_commit  # (rows, tokens, errors) of each committed block
        self.next_block = 0
        self.meta_json: str | None = None  # the provenance every row must carry
        self._schema: pa.Schema | None = None
        self._pieces: dict[int, list[pa.Table]] = {}
        self._have: dict[int, int] = {}
        self._expect: dict[int, int] = {}

    @property
    def meta(self) -> dict | None:
        return None if self.meta_json is None else json.loads(self.meta_json)

    @property
    def held_blocks(self) -> int:
        """Blocks received and not yet committed (waiting for an earlier one)."""
        return len(self._pieces)

    def add(self, table: pa.Table) -> None:
        """One result table from the actors: its blocks are held, then committed in order."""
        if table.num_rows == 0:
            return
        blocks = table.column("block")
        for block in pc.unique(blocks).to_pylist():
            piece = table.filter(pc.equal(blocks, block))
            self._pieces.setdefault(block, []).append(piece)
            self._have[block] = self._have.get(block, 0) + piece.num_rows
            self._expect[block] = piece.column("block_rows")[0].as_py()
            if self._have[block] > self._expect[block]:
                raise JobAborted(
                    f"block {block} came back with {self._have[block]} rows, "
                    f"{self._expect[block]} were read"
                )
        while self._have.get(self.next_block, -1) == self._expect.get(self.next_block):
            self._commit(self.next_block)
            self.next_block += 1

    def _commit(self, block: int) -> None:
        table = pa.concat_tables(self._pieces.pop(block)).sort_by("line")
        del self._have[block], self._expect[block]
        self._check_provenance(table)
        bad = table.filter(pc.is_valid(table.column("error_code")))
        good = table.filter(pc.is_null(table.column("error_code")))
        names = table.column_names
        if "error_record" in names:  # late chunking: a document's record stands for its rows
            errors = [json.loads(r) for r in bad.column("error_record").to_pylist()]
        else:
            errors = [
                {
                    "line": r["line"],
                    "id": r["id"],
                    "error": {"code": r["error_code"], "message": r["error_message"]},
                }
                for r in bad.select(["line", "id", "error_code", "error_message"]).to_pylist()
            ]
        vectors = None
        if self.opts.dense:
            vectors = convert(float_vectors(good.column("embedding")), self.opts.dtype, self.ranges)
        n_tokens = good.column("n_tokens").to_pylist()
        assert self._schema is not None  # bound with the first rows
        known = {"id", "embedding", "n_tokens", "truncated"}
        extra = [  # the token-level outputs' columns, as the actors built them
            good.column(f.name).combine_chunks() for f in self._schema if f.name not in known
        ]
        part = make_table(
            good.column("id").to_pylist(),
            vectors,
            n_tokens,
            good.column("truncated").to_pylist(),
            self._schema,
            extra,
        )
        # A late-chunking window says what it read (overlapping forward windows) and where
        # the input goes on (past rows its records stand for); a row block, its rows do.
        if "block_tokens" in names:
            tokens = table.column("block_tokens")[0].as_py()
            next_line = table.column("block_next_line")[0].as_py()
        else:
            tokens = sum(n_tokens)
            next_line = table.column("line")[-1].as_py() + 1
        with _full_disk_aborts(self.ckpt.root, _resume_advice(self.ckpt)):
            self.ckpt.commit(part, errors, next_line, tokens)
        if self.on_commit is not None:
            self.on_commit(good.num_rows, tokens, len(errors))
        _raise_if_over_max_errors(self.ckpt, self.opts)

    def _check_provenance(self, table: pa.Table) -> None:
        """Every row embedded with the same artifact, and that the checkpoint's own."""
        metas = set(table.column("_meta").unique().to_pylist())
        if self.meta_json is not None:
            metas.add(self.meta_json)
        if len(metas) > 1:
            raise JobAborted(f"the nodes embedded with different models/artifacts: {sorted(metas)}")
        if self.meta_json is None:
            self.bind(metas.pop())

    def bind(self, meta_json: str) -> None:
        """The run's provenance: the checkpoint refuses another artifact or prompt."""
        meta = json.loads(meta_json)
        with _full_disk_aborts(self.ckpt.root, _resume_advice(self.ckpt)):
            self.ckpt.bind_artifact(meta["artifact_digest"], meta["prompt"])
        self.meta_json = meta_json
        self._schema = _schema(self.opts, meta, with_metadata=False)


def float_vectors(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A float32 `fixed_size_list` column as an (n, dims) matrix; a slice's offset is kept
    (`flatten`, unlike `.values`, starts at the slice)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    dims = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dims)

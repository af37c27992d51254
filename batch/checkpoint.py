"""The checkpoint of an unfinished job: `OUTPUT.partial/` beside the output.

Contents: `part-NNNNNN.parquet` (one committed window each, in input order), `errors.jsonl`
(the committed error records) and `state.json`, the commit record:
    {"job": {...what the command asked...}, "next_line": N, "parts": P, "rows": R,
     "tokens": T, "errors": E, "errors_bytes": B, "artifact_digest": D, "prompt": TEXT}
A window commits in three atomic steps: its part file (tmp + fsync + rename), its error
records (appended + fsync), then `state.json` (tmp + fsync + rename). `state.json` is the
truth: on resume, a part numbered >= P or error bytes past B come from a commit that never
finished and are discarded, and the input continues at `next_line`. So a SIGKILL anywhere
loses at most the windows in flight, and no row is written twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa

from batch.errors import BatchUsageError
from batch.output import write_part
from ingest.durable import fsync_dir

STATE = "state.json"
ERRORS = "errors.jsonl"


def checkpoint_dir(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


class Checkpoint:
    def __init__(self, root: Path, state: dict) -> None:
        self.root = root
        self.state = state

    @classmethod
    def open(cls, output: Path, job: dict, resume: bool) -> Checkpoint:
        root = checkpoint_dir(output)
        parent = output.parent
        if not parent.is_dir():
            raise BatchUsageError(f"output directory {parent} does not exist")
        if root.is_dir() and (root / STATE).is_file():
            if not resume:
                done = _read_state(root).get("rows", 0)
                raise BatchUsageError(
                    f"an unfinished job left a checkpoint at {root} ({done} rows done): pass "
                    f"--resume to continue it, or delete it to start over"
                )
            ckpt = cls(root, _read_state(root))
            ckpt._check_same_job(job)
            ckpt._discard_uncommitted()
            return ckpt
        try:
            shutil.rmtree(root, ignore_errors=True)  # a dir without state never committed
            root.mkdir()
            probe = root / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise BatchUsageError(
                f"cannot write in the output directory {parent}: {exc.strerror or exc}"
            ) from None
        state = {
            "job": job,
            "next_line": 1,
            "parts": 0,
            "rows": 0,
            "tokens": 0,
            "errors": 0,
            "errors_bytes": 0,
            "artifact_digest": None,
        }
        ckpt = cls(root, state)
        (root / ERRORS).write_bytes(b"")
        ckpt._write_state()
        return ckpt

    # ---- reading ----------------------------------------------------------------------------

    @property
    def next_line(self) -> int:
        return self.state["next_line"]

    @property
    def errors_path(self) -> Path:
        return self.root / ERRORS

    def parts(self) -> list[Path]:
        return [self._part(i) for i in range(self.state["parts"])]

    def bind_artifact(self, digest: str, prompt: str = "") -> None:
        """The model must be the very artifact the checkpoint's rows were embedded with, and
        the rows must get the same prompt (a model ingested again may declare another)."""
        s = self.state
        known = s.get("artifact_digest")
        if known is None:
            s["artifact_digest"], s["prompt"] = digest, prompt
            self._write_state()
            return
        if known != digest:
            raise BatchUsageError(
                f"the checkpoint at {self.root} was embedded with artifact {known[:12]}, the "
                f"model is now {digest[:12]}: delete the checkpoint to start over"
            )
        # A checkpoint from before prompts were recorded embedded its rows without one.
        if s.get("prompt", "") != prompt:
            raise BatchUsageError(
                f"the checkpoint at {self.root} was embedded with the prompt "
                f"{s.get('prompt', '')!r}, the rows would now get {prompt!r}: delete the "
                f"checkpoint to start over"
            )

    # ---- committing -------------------------------------------------------------------------

    def commit(
        self, table: pa.Table | None, errors: list[dict], next_line: int, tokens: int
    ) -> None:
        s = self.state
        if table is not None and table.num_rows:
            write_part(self._part(s["parts"]), table)
            s["parts"] += 1
            s["rows"] += table.num_rows
        if errors:
            data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors).encode()
            with open(self.errors_path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            s["errors"] += len(errors)
            s["errors_bytes"] += len(data)
        s["next_line"] = next_line
        s["tokens"] += tokens
        self._write_state()

    def remove(self) -> None:
        # state.json first: a removal cut short leaves a directory without it, which is no
        # checkpoint (the next run clears it), never one naming parts already deleted.
        (self.root / STATE).unlink(missing_ok=True)
        fsync_dir(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- internals --------------------------------------------------------------------------

    def _part(self, index: int) -> Path:
        return self.root / f"part-{index:06d}.parquet"

    def _write_state(self) -> None:
        tmp = self.root / (STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / STATE)
        fsync_dir(self.root)

    def _check_same_job(self, job: dict) -> None:
        old = self.state.get("job", {})
        diffs = [
            f"{k}: {old.get(k)!r} -> {job.get(k)!r}"
            for k in sorted(set(old) | set(job))
            if old.get(k) != job.get(k)
        ]
        if diffs:
            raise BatchUsageError(
                f"the checkpoint at {self.root} belongs to another job ({'; '.join(diffs)}); "
                f"run the same command, or delete the checkpoint to start over"
            )

    def _discard_uncommitted(self) -> None:
        committed = {self._part(i).name for i in range(self.state["parts"])}
        for path in self.root.iterdir():
            if path.name.startswith("part-") and path.name not in committed:
                path.unlink()
            elif path.name.endswith(".tmp"):
                path.unlink()
        with contextlib.suppress(FileNotFoundError), open(self.errors_path, "r+b") as f:
            f.truncate(self.state["errors_bytes"])


def _read_state(root: Path) -> dict:
    try:
        return json.loads((root / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise BatchUsageError(
            f"the checkpoint at {root} is unreadable ({exc}); delete it to start over"
        ) from None

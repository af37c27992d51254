"""GGUFs other tools already downloaded: Ollama's store and LM Studio's folder.

- `ollama:NAME[:TAG]` (or `ollama:NAMESPACE/NAME[:TAG]`): Ollama keeps its models under
  `OLLAMA_MODELS` (default `~/.ollama/models`): a manifest at
  `manifests/registry.ollama.ai/<NAMESPACE, default library>/NAME/TAG` (a JSON image
  manifest; TAG defaults to `latest`) whose layer of mediaType
  `application/vnd.ollama.image.model` is the GGUF, stored content-addressed at
  `blobs/sha256-<hex>`. The blob must hash to its digest (`digest_mismatch` otherwise): a
  damaged or replaced blob is never ingested.
- `lmstudio:PUBLISHER/REPO[/FILE]`: LM Studio keeps `~/.lmstudio/models/PUBLISHER/REPO/*.gguf`
  (`LMSTUDIO_MODELS` names another folder); FILE may be left out when the folder holds one
  model GGUF (vision projectors, `mmproj*`, are not models).

Either is published WITHOUT a second copy (`ArtifactStore.ingest_gguf(link=True)`): a hard
link when the store and the other tool's folder share a filesystem, else a symbolic link
(the worker re-hashes the artifact at LOAD, so a file changed behind our back is refused, not
served). Everything else is what `models ingest FILE.gguf` does: the kind and pooling from
the GGUF's metadata, a tokenizer derived from its vocabulary and proven equal to llama.cpp's,
or a refusal that says why.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from common.errors import ArtifactInvalid, InvalidRequest, ModelNotFound
from formats.digest import sha256_file
from ingest.errors import DigestMismatch
from ingest.provenance import Provenance
from ingest.store import ArtifactStore, ModelRecord, TokenizerProof

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class LocalGguf:
    """One GGUF found in another tool's folder: where it is, its checked digest (None: not
    hashed yet, LM Studio keeps none), what the manifest will record, and a store name."""

    path: Path
    digest: str | None
    provenance: Provenance
    name: str


def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def lmstudio_root() -> Path:
    env = os.environ.get("LMSTUDIO_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".lmstudio" / "models"


def is_local_ref(text: str) -> bool:
    return text.startswith(("ollama:", "lmstudio:"))


def resolve_local(text: str, check_digest: bool = True) -> LocalGguf:
    if text.startswith("ollama:"):
        return resolve_ollama(text.removeprefix("ollama:"), check_digest)
    if text.startswith("lmstudio:"):
        return resolve_lmstudio(text.removeprefix("lmstudio:"))
    raise InvalidRequest(f"{text!r} names neither ollama: nor lmstudio:")


# ---- Ollama ---------------------------------------------------------------------------------


def _ollama_parts(ref: str) -> tuple[str, str, str]:
    """NAME[:TAG] or NAMESPACE/NAME[:TAG] -> (namespace, name, tag)."""
    path, _, tag = ref.partition(":")
    parts = path.split("/")
    if len(parts) == 1:
        parts = ["library", *parts]
    tag = tag or "latest"
    if len(parts) != 2 or not all(_PART.fullmatch(p) for p in [*parts, tag]):
        raise InvalidRequest(f"ollama:{ref} is not an Ollama model name (NAME[:TAG])")
    return parts[0], parts[1], tag


def _ollama_label(namespace: str, name: str, tag: str) -> str:
    return f"{name}:{tag}" if namespace == "library" else f"{namespace}/{name}:{tag}"


def resolve_ollama(ref: str, check_digest: bool = True) -> LocalGguf:
    namespace, name, tag = _ollama_parts(ref)
    root = ollama_root()
    manifest = root / "manifests" / OLLAMA_REGISTRY / namespace / name / tag
    label = _ollama_label(namespace, name, tag)
    try:
        data = manifest.read_bytes()
    except FileNotFoundError:
        raise ModelNotFound(
            f"Ollama's store ({root}) has no {label}: `ollama pull {label}` fetches it "
            "(OLLAMA_MODELS names another store)"
        ) from None
    except OSError as e:
        raise ArtifactInvalid(f"cannot read Ollama's manifest {manifest}: {e}") from None
    hexdigest = _model_layer(manifest, data)
    blob = root / "blobs" / f"sha256-{hexdigest}"
    if not blob.is_file():
        raise ArtifactInvalid(f"Ollama's {label} names the blob {blob}, which is missing")
    if check_digest:
        got = sha256_file(blob)
        if got != hexdigest:
            raise DigestMismatch(
                f"Ollama's blob {blob.name} for {label} hashes to sha256:{got[:12]}...: it is "
                "damaged or was replaced (`ollama pull` it again)"
            )
    prov = Provenance(
        origin="ollama",
        repo=label,
        revision=_sha256_bytes(data),
        files={"model.gguf": hexdigest},
    )
    return LocalGguf(
        blob, hexdigest, prov, _store_name(name if tag == "latest" else f"{name}-{tag}")
    )


def _model_layer(manifest: Path, data: bytes) -> str:
    """The hex sha256 of the manifest's model layer."""
    try:
        doc = json.loads(data)
        layers = doc["layers"]
        digests = [x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactInvalid(f"{manifest} is not an Ollama image manifest: {e}") from None
    if len(digests) != 1:
        raise ArtifactInvalid(f"{manifest} has {len(digests)} model layers, not one")
    algo, _, hexdigest = str(digests[0]).partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise ArtifactInvalid(f"{manifest}: the model layer's digest {digests[0]!r} is not sha256")
    return hexdigest


def _sha256_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def ollama_models() -> Iterator[str]:
    """Every NAME:TAG (NAMESPACE/NAME:TAG outside `library`) in Ollama's store."""
    base = ollama_root() / "manifests" / OLLAMA_REGISTRY
    if not base.is_dir():
        return
    for manifest in sorted(base.glob("*/*/*")):
        if manifest.is_file():
            namespace, name, tag = manifest.relative_to(base).parts
            yield _ollama_label(namespace, name, tag)


# ---- LM Studio ------------------------------------------------------------------------------


def resolve_lmstudio(ref: str) -> LocalGguf:
    parts = ref.split("/")
    if len(parts) not in (2, 3) or not all(_PART.fullmatch(p) for p in parts):
        raise InvalidRequest(f"lmstudio:{ref} is not PUBLISHER/REPO[/FILE.gguf]")
    root = lmstudio_root()
    folder = root / parts[0] / parts[1]
    if len(parts) == 3:
        path = folder / parts[2]
        if not path.is_file():
            raise ModelNotFound(f"LM Studio's folder ({root}) has no {ref}")
    else:
        models = lmstudio_files(folder)
        if not models:
            raise ModelNotFound(f"LM Studio's folder ({root}) has no GGUF under {ref}")
        if len(models) > 1:
            raise InvalidRequest(
                f"lmstudio:{ref} holds {len(models)} GGUFs ({', '.join(p.name for p in models)}):"
                f" name one, lmstudio:{ref}/FILE"
            )
        path = models[0]
    label = f"{parts[0]}/{parts[1]}/{path.name}"
    prov = Provenance(origin="lmstudio", repo=label)
    return LocalGguf(path, None, prov, _store_name(path.stem))


def lmstudio_files(folder: Path) -> list[Path]:
    """A repository folder's model GGUFs (vision projectors are not models)."""
    return sorted(
        p for p in folder.glob("*.gguf") if p.is_file() and not p.name.startswith("mmproj")
    )


def lmstudio_models() -> Iterator[str]:
    """Every PUBLISHER/REPO/FILE in LM Studio's folder."""
    root = lmstudio_root()
    if not root.is_dir():
        return
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        for path in lmstudio_files(folder):
            yield f"{folder.parent.name}/{folder.name}/{path.name}"


def _store_name(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.")[:64] or "model"


# ---- into the store -------------------------------------------------------------------------


def ingest_local(
    store: ArtifactStore, text: str, name: str | None, prove: TokenizerProof, **options: Any
) -> tuple[ModelRecord, bool]:
    """`models ingest ollama:...` / `lmstudio:...`: the record, and whether it was new (a
    model already ingested from the same file is the answer, not a second entry)."""
    found = resolve_local(text)
    digest = found.digest or sha256_file(found.path)
    prov = found.provenance
    if not prov.files:
        prov = msgspec.structs.replace(prov, files={found.path.name: digest})
    present = [r for r in store.find(prov.origin, prov.repo) if r.digest == digest]
    if present and name is None:
        return present[0], False
    rec = store.ingest_gguf(
        found.path,
        name or found.name,
        prove=prove,
        source=f"gguf:{found.path}",
        provenance=prov,
        link=True,
        digest=digest,
        **options,
    )
    return rec, True

"""The artifact store: one directory per model under the user cache dir.

Layout of `<root>/<name>/`:
    model.gguf            the artifact
    model.gguf.sha256     its sha256 (sha256sum format), computed ONCE at ingest
    tokenizer.json        module-side tokenizer (optional for generation models until derived)
    manifest.json         `Manifest` (name, format, kind, dims, pooling, limits, digest, source,
                          prompts and Matryoshka widths: ingest.encode_options)

Publishing is atomic: a model is built in `<root>/.tmp-*` and renamed into place, so a reader
sees either no model or a complete one. It is also durable: every file and the staging dir
are fsynced before the rename and the root after it (manifest rewrites likewise), so a power
cut cannot leave a published name with an empty manifest. What a crash leaves behind
(`.tmp-*` builds, `.rm-*` graves, `*.tmp` files) is swept by the next mutation, under the lock
every builder holds, so nothing live is ever swept.

The default embedder is held in both precisions, `minilm-l6-v2-f16` and `minilm-l6-v2-f32`;
`minilm-l6-v2` is the one this platform serves by default (`ingest.precision`), a
second name for the same bytes (hard links: no second conversion, no extra disk).

Mutations hold a file lock on `<root>/.lock` so two processes ingesting the defaults at once
do the work once.

A build the disk cannot hold is refused before it writes (`StorageFull`, with what it needs
and what is free); one that fills the disk midway (another writer took the space) is a
`StorageFull` too, and its staging dir is gone either way: a full disk costs the store
nothing it had.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import platformdirs
from filelock import FileLock

from common.errors import ArtifactInvalid, InvalidRequest, ModelNotFound, StorageFull
from formats.digest import sha256_file
from formats.gguf_header import ArrayInfo
from formats.safetensors_io import weight_elements
from formats.sparse_head import HEADS_DIR as SPARSE_HEADS_DIR
from formats.sparse_head import PER_TOKEN_HEADS, SPARSE_CONFIG
from ingest import gemma
from ingest.digest import copy_with_digest, read_digest_file, write_digest_file
from ingest.durable import (
    free_bytes,
    fsync_dir,
    fsync_file,
    full_disk_as,
    mib,
    require_space,
)
from ingest.encode_options import EncodeOptions, encode_options, fitted, given_options
from ingest.errors import ArtifactExists
from ingest.gguf_model import ITEM_LIMIT, inspect_gguf, read_header
from ingest.gguf_vocab import UnsupportedVocab, write_tokenizer_json
from ingest.hf_common import Dtype, PoolingName
from ingest.hf_dir import convert_hf_dir
from ingest.llm_rerank import LlmRerankSpec
from ingest.model_packages import minilm_dir, minilm_source
from ingest.multivector_heads import detect as detect_multivector
from ingest.multivector_heads import ingest_multivector_head
from ingest.precision import embed_precision
from ingest.provenance import Provenance
from ingest.quantization import QuantizationRanges
from ingest.sparse_heads import encoder_dir, sparse_source, write_sparse_heads

Kind = Literal["embed", "rerank", "generate"]
ARTIFACT_FILE = "model.gguf"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
# What a GGUF holds beside its tensors (metadata, vocabulary), over-estimated for BERTs.
GGUF_OVERHEAD_BYTES = 4 << 20

DEFAULT_EMBED = "minilm-l6-v2"
DEFAULT_EMBED_F16 = "minilm-l6-v2-f16"
DEFAULT_EMBED_F32 = "minilm-l6-v2-f32"
EMBED_BY_DTYPE: dict[Dtype, str] = {"f16": DEFAULT_EMBED_F16, "f32": DEFAULT_EMBED_F32}
DEFAULT_GENERATE = "gemma3-270m"
# Generation defaults: generation is short by policy (at most 64 new tokens, so a request
# cannot hold a worker for long); the runtime context is far below Gemma's 32k training
# context because prompts here are short.
GEMMA_MAX_NEW_TOKENS = 64
GEMMA_N_CTX = 2048

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # fullmatch: `$` would let a "\n" through

# A tokenizer.json builder for GGUF vocabularies: (gguf_path, out_tokenizer_json) -> anything.
TokenizerBuilder = Callable[[Path, Path], Any]
# A proof that a derived tokenizer equals llama.cpp's: (gguf, tokenizer_json) -> anything,
# raising TokenizerMismatch (ingest cannot run llama.cpp itself: the host never imports it).
TokenizerProof = Callable[[Path, Path], Any]


class HeadSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A head that runs in the worker on the token states (a sparse or multi-vector output):
    its weights' file under the model dir, and the width of what it returns (the vocabulary
    for a sparse head)."""

    file: str
    dims: int
    digest: str = ""  # sha256 of what ingest wrote, checked by the worker before it loads
    # Inference-free query side: queries are weighed by their ids alone, tokenized without
    # special tokens (as its SparseStaticEmbedding tokenizes them), and read by no forward.
    bare_query: bool = False
    # A sparse head's bound on one item's entries, below the vocabulary: at most one per token
    # of the item (every route keeps one weight per distinct token id: bge-m3's lexical
    # weights, a static route), and at most `max_active` (the model's top-k; 0: no cut). The
    # host sizes its requests by the widest reply an item can take.
    entries_per_token: bool = False
    max_active: int = 0
    # A multi-vector head's rows per item: the item's ids, plus the side's prefix ids the
    # worker inserts (at most `prefix_rows`), or a query padded to `expansion_rows`.
    prefix_rows: int = 0
    expansion_rows: int = 0


class Manifest(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    format: str  # always "gguf" in this store
    kind: Kind
    digest: str  # sha256 hex of `artifact`
    size_bytes: int
    dims: int  # embedding width (n_embd)
    n_ctx: int  # runtime context the host should LOAD with
    n_ctx_train: int  # the model's position limit
    max_tokens: int  # default per-item input token limit (embed/rerank) or prompt limit
    max_tokens_limit: int  # hard input limit; requests above it are refused
    source: str
    created_at: str
    artifact: str = ARTIFACT_FILE
    tokenizer: str | None = None  # file name in the model dir, None until derived
    pooling: str | None = None  # mean|cls|last|rank for encoders
    dtype: str | None = None  # f32|f16|q4_k_m
    max_new_tokens: int | None = None  # generation default cap
    n_labels: int | None = None  # classifier outputs (rerank)
    # A sequence classifier's label names by id, and its problem_type (None: by the label
    # count, as transformers decides); host.classify picks the activation from them.
    labels: list[str] = []
    problem_type: str | None = None
    # sentence-transformers' prompts (name -> text prepended to every input), and the one a
    # call that names none gets.
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    matryoshka_dims: list[int] = []  # widths the vectors may be cut to, widest first
    # int8/uint8 ranges per served width, recorded on first use (ingest.quantization); a
    # manifest without them is simply not calibrated yet.
    quantization: QuantizationRanges | None = None
    # What the files are upstream (a Hub repository at a commit, an Ollama model...), with
    # the digests of the files read; None for a local directory or file (`source` says which).
    provenance: Provenance | None = None
    # An LLM reranker's chat template, scored tokens and instructions (ingest.llm_rerank): the
    # host renders its pairs through them. None for every other model.
    llm_rerank: LlmRerankSpec | None = None
    # Heads on the token states by the output they give ("sparse", "multivector").
    heads: dict[str, HeadSpec] = {}
    # What the model returns when it has no pooled vector of its own (a SPLADE model:
    # ["sparse", "tokens"]); empty: a pooled vector, token states and its heads.
    outputs: list[str] = []


def _ingest_heads(src: Path, staging: Path) -> tuple[dict[str, HeadSpec], list[str]]:
    """The heads a checkpoint carries beside its transformer, written under `staging`, and
    what the model serves when it has no pooled vector of its own (a ColBERT model's vectors
    are its output; bge-m3 keeps its CLS vector)."""
    heads: dict[str, HeadSpec] = {}
    outputs: list[str] = []
    mv = ingest_multivector_head(src, staging)
    if mv is not None:
        heads["multivector"] = HeadSpec(
            file=mv.file,
            dims=mv.dims,
            digest=mv.digest,
            prefix_rows=mv.prefix_rows,
            expansion_rows=mv.expansion_rows,
        )
        if mv.kind != "bge-m3":
            outputs = ["multivector", "tokens"]
    source = sparse_source(src)
    if source is not None:
        sp = write_sparse_heads(src, staging)
        heads["sparse"] = HeadSpec(
            file=f"{SPARSE_HEADS_DIR}/{SPARSE_CONFIG}",
            dims=sp.vocab_size,
            digest=sp.digest,
            bare_query=not sp.query_needs_forward,
            entries_per_token=all(k in PER_TOKEN_HEADS for k in sp.routes.values()),
            max_active=sp.max_active_dims or 0,
        )
        if source != "bge_m3":  # SPLADE's vector is its output; bge-m3 keeps its CLS vector
            outputs = ["sparse", "tokens"]
    return heads, outputs


def served_outputs(manifest: Manifest) -> list[str]:
    """The outputs an embedder serves: its own list, else the pooled vector, the token
    states and one per head."""
    if manifest.outputs:
        return list(manifest.outputs)
    return ["dense", "tokens", *manifest.heads]


class ModelRecord(msgspec.Struct, frozen=True):
    """A manifest plus where it lives."""

    manifest: Manifest
    dir: Path

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def kind(self) -> Kind:
        return self.manifest.kind

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def artifact_path(self) -> Path:
        return self.dir / self.manifest.artifact

    @property
    def tokenizer_path(self) -> Path | None:
        return self.dir / self.manifest.tokenizer if self.manifest.tokenizer else None


def default_root() -> Path:
    env = os.environ.get("SYNAPSE_CACHE_DIR")
    base = Path(env) if env else Path(platformdirs.user_cache_dir("synapse"))
    return base / "models"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _cleaned_tokenizer(src: Path) -> bytes:
    """A tokenizer.json's bytes without its padding/truncation settings.

    Hub tokenizers often carry e.g. `padding: Fixed(128)`; the host never pads (no padding on
    the wire) and truncation is an explicit per-request policy, so neither may hide in here.
    """
    try:
        data = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactInvalid(f"unreadable {src}: {e}") from e
    data["padding"] = None
    data["truncation"] = None
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


class ArtifactStore:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(str(self.root / ".lock"))

    # ---- queries ---------------------------------------------------------------------------

    def get(self, name: str) -> ModelRecord:
        _check_name(name)
        mdir = self.root / name
        path = mdir / MANIFEST_FILE
        try:
            manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
        except FileNotFoundError as e:
            raise ModelNotFound(f"no model named {name!r} in {self.root}") from e
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ArtifactInvalid(f"{path}: {e}") from e
        return ModelRecord(manifest=manifest, dir=mdir)

    def ls(self) -> list[ModelRecord]:
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / MANIFEST_FILE).is_file():
                continue
            try:
                out.append(self.get(d.name))
            except ArtifactInvalid:
                continue  # a damaged entry must not hide the others; `verify` reports it
        return out

    def find(self, origin: str, repo: str, revision: str | None = None) -> list[ModelRecord]:
        """The installed models whose provenance is `repo` from `origin` (at `revision`, a
        resolved commit or digest, when given)."""
        return [
            r
            for r in self.ls()
            if (p := r.manifest.provenance) is not None
            and p.origin == origin
            and p.repo == repo
            and (revision is None or p.revision == revision)
        ]

    def verify(self, name: str) -> ModelRecord:
        """Re-hash the artifact and compare with the digest recorded at ingest."""
        rec = self.get(name)
        try:
            got = sha256_file(rec.artifact_path)
        except OSError as e:
            raise ArtifactInvalid(f"{name}: cannot read artifact: {e}") from e
        side = read_digest_file(rec.artifact_path)
        if got != rec.digest or side != rec.digest:
            raise ArtifactInvalid(f"{name}: artifact sha256 {got} != recorded {rec.digest}")
        return rec

    # ---- mutations -------------------------------------------------------------------------

    def rm(self, name: str) -> None:
        _check_name(name)
        with self._lock:
            self._sweep()
            mdir = self.root / name
            if not mdir.is_dir():
                raise ModelNotFound(f"no model named {name!r} in {self.root}")
            # Rename first so readers never see a half-deleted model.
            grave = Path(tempfile.mkdtemp(prefix=".rm-", dir=self.root))
            os.replace(mdir, grave / name)
            shutil.rmtree(grave, ignore_errors=True)

    def ingest_hf_dir(
        self,
        path: str | Path,
        name: str | None = None,
        dtype: Dtype | None = None,
        *,
        pooling: PoolingName | None = None,
        source: str | None = None,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        matryoshka_dims: list[int] | None = None,
        provenance: Provenance | None = None,
        true_token: str | None = None,
        false_token: str | None = None,
    ) -> ModelRecord:
        """Convert a Hugging Face directory of a supported family (`ingest.hf_dir.FAMILIES`) to
        GGUF and publish it as `name`.

        `dtype` None: this platform's embedding precision (`embed_precision`). A default name
        gets a `-f32` suffix only when f32 was asked for explicitly. The manifest records the
        directory's sentence-transformers prompts; `prompts` adds to or replaces them by name,
        `default_prompt_name` names the one applied when a call names none, and
        `matryoshka_dims` the widths the vectors may be cut to (see ingest.encode_options).
        `true_token` / `false_token` name an LLM reranker's scored tokens (default "yes"/"no").
        """
        path = Path(path)
        options = encode_options(path, prompts, default_prompt_name, matryoshka_dims)
        if name is None:
            name = re.sub(r"[^a-z0-9._-]+", "-", path.name.lower()).strip("-.") or "model"
            if dtype == "f32":
                name += "-f32"
        dtype = dtype or embed_precision().dtype
        _check_name(name)
        if pooling is None and (
            detect_multivector(path) not in (None, "bge-m3")
            or sparse_source(path) not in (None, "bge_m3")
        ):
            # Its vectors are its output, never a pooled one (Manifest.outputs leaves the
            # pooled vector out): any pooling makes the GGUF an embedder llama.cpp loads.
            pooling = "mean"
        with self._lock:
            self._sweep()
            if (self.root / name).exists():
                raise ArtifactExists(f"a model named {name!r} already exists")
            return self._build_hf(
                path,
                name,
                dtype,
                pooling,
                source or f"hf-dir:{path}",
                options=options,
                provenance=provenance,
                tokens=(true_token, false_token),
            )

    def ingest_gguf(
        self,
        path: str | Path,
        name: str | None = None,
        *,
        prove: TokenizerProof,
        kind: Literal["embed", "rerank"] | None = None,
        pooling: str | None = None,
        max_tokens: int | None = None,
        source: str | None = None,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        matryoshka_dims: list[int] | None = None,
        provenance: Provenance | None = None,
        link: bool = False,
        digest: str | None = None,
    ) -> ModelRecord:
        """Publish an embedding or rerank GGUF as `name`, with a module-side tokenizer derived
        from its own vocabulary and proven equal to llama.cpp's by `prove(gguf, tokenizer)`
        (which raises `TokenizerMismatch`; `certification.tokenizer_proof` is the real one).
        What the GGUF is comes from its metadata (`ingest.gguf_model`); `kind` / `pooling`
        say what it does not, `max_tokens` lowers the default truncation. A GGUF holds no
        sentence-transformers prompts: `prompts` / `default_prompt_name` / `matryoshka_dims`
        give them (see ingest.encode_options).

        `link`: the file belongs to another tool's store (Ollama's blobs, LM Studio's folder)
        and is not copied: the artifact is a hard link to it when both stores share a
        filesystem, else a symbolic link (a reference the worker's digest check at LOAD
        guards). `digest`: its sha256 when the caller has just checked it."""
        path = Path(path)
        info = inspect_gguf(path, kind, pooling)
        options = fitted(
            given_options(prompts, default_prompt_name, matryoshka_dims), info.kind, info.dims
        )
        if max_tokens is not None and not 1 <= max_tokens <= info.item_limit:
            raise InvalidRequest(f"max_tokens must be between 1 and {info.item_limit}")
        if name is None:
            name = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-.") or "model"
        _check_name(name)
        with self._lock:
            self._sweep()
            if (self.root / name).exists():
                raise ArtifactExists(f"a model named {name!r} already exists")
            size = 0 if link else path.stat().st_size
            with self._staging(name, size + GGUF_OVERHEAD_BYTES) as staging:
                artifact = staging / ARTIFACT_FILE
                if link:
                    digest = digest or sha256_file(path)
                    link_artifact(path, artifact)
                else:
                    digest = copy_with_digest(path, artifact)
                write_digest_file(artifact, digest)
                try:
                    write_tokenizer_json(artifact, staging / TOKENIZER_FILE)
                except UnsupportedVocab as e:
                    raise ArtifactInvalid(f"{path.name}: {e}") from None
                prove(artifact, staging / TOKENIZER_FILE)
                manifest = Manifest(
                    name=name,
                    format="gguf",
                    kind=info.kind,
                    digest=digest,
                    size_bytes=artifact.stat().st_size,
                    dims=info.dims,
                    n_ctx=info.item_limit,
                    n_ctx_train=info.n_ctx_train,
                    max_tokens=max_tokens or info.item_limit,
                    max_tokens_limit=info.item_limit,
                    source=source or f"gguf:{path}",
                    created_at=_now(),
                    tokenizer=TOKENIZER_FILE,
                    pooling=info.pooling,
                    dtype=info.dtype,
                    n_labels=info.n_labels,
                    labels=info.labels,
                    prompts=options.prompts,
                    default_prompt_name=options.default_prompt_name,
                    matryoshka_dims=options.matryoshka_dims,
                    provenance=provenance,
                    llm_rerank=info.llm_rerank,
                )
                return self._publish(staging, manifest)

    def update_manifest(
        self, name: str, digest: str, change: Callable[[Manifest], Manifest]
    ) -> ModelRecord | None:
        """Rewrite `name`'s manifest as `change(current)` (atomically and durably), if it still
        describes the artifact `digest`; None (nothing written) when another artifact was
        published under the name meanwhile. For what is learnt about a model after ingest."""
        with self._lock:
            rec = self.get(name)
            if rec.digest != digest:
                return None
            manifest = change(rec.manifest)
            if manifest != rec.manifest:
                full = lambda exc: StorageFull(  # noqa: E731
                    f"no space left under {self.root} to rewrite {name!r}'s manifest "
                    f"({exc.strerror or exc}); the model is as it was"
                )
                with full_disk_as(full, self.root):
                    try:
                        _write_manifest(rec.dir, manifest)
                    except BaseException:
                        (rec.dir / (MANIFEST_FILE + ".tmp")).unlink(missing_ok=True)
                        raise
            return ModelRecord(manifest=manifest, dir=rec.dir)

    def attach_tokenizer(self, name: str, tokenizer_json: str | Path) -> ModelRecord:
        """Add or replace a model's tokenizer.json (e.g. one derived from a GGUF vocab).
        Cleaned in memory first, so a disk it does not fit is refused before anything is
        written."""
        with self._lock:
            self._sweep()
            rec = self.get(name)
            data = _cleaned_tokenizer(Path(tokenizer_json))
            return self._replace_tokenizer(rec, lambda tmp: tmp.write_bytes(data), len(data))

    def ingest_default(
        self, tokenizer_builder: TokenizerBuilder | None = None, embed_dtype: Dtype | None = None
    ) -> dict[str, ModelRecord]:
        """Install the embedded defaults; idempotent, and fast when they are present.

        `minilm-l6-v2-f16`, `minilm-l6-v2-f32`, `minilm-l6-v2` (the one of those two in
        `embed_dtype`, default: this platform's `embed_precision()`) and `gemma3-270m`. An
        existing entry is kept when its manifest names the same source and precision and the
        artifact has the recorded size; it is not re-hashed here (the worker re-verifies the
        digest at LOAD). With `tokenizer_builder`, Gemma gets a tokenizer.json derived from
        its GGUF vocabulary.
        """
        # The package's directory is asked for only when a build needs it: where it is not
        # installed, asking installs it (model_packages), and present entries need no files.
        minilm_src = minilm_source()
        embed_dtype = embed_dtype or embed_precision().dtype
        out: dict[str, ModelRecord] = {}
        with self._lock:
            self._sweep()
            for dtype, name in EMBED_BY_DTYPE.items():
                rec = self._present(name, minilm_src, dtype)
                if rec is None:
                    self._discard(name)
                    # general.name is the model's, not the entry's: both names of one
                    # precision are then the same bytes.
                    rec = self._build_hf(
                        minilm_dir(), name, dtype, None, minilm_src, model_name=DEFAULT_EMBED
                    )
                out[name] = rec
            rec = self._present(DEFAULT_EMBED, minilm_src, embed_dtype)
            if rec is None:
                self._discard(DEFAULT_EMBED)
                rec = self._publish_second_name(out[EMBED_BY_DTYPE[embed_dtype]], DEFAULT_EMBED)
            out[DEFAULT_EMBED] = rec
            rec = self._present(DEFAULT_GENERATE, gemma.source())
            if rec is None:
                self._discard(DEFAULT_GENERATE)
                rec = self._build_gemma(DEFAULT_GENERATE, tokenizer_builder)
            elif rec.manifest.tokenizer is None and tokenizer_builder is not None:
                rec = self._derive_tokenizer(rec, tokenizer_builder, gemma.DERIVED_TOKENIZER_BYTES)
            out[DEFAULT_GENERATE] = rec
        return out

    # ---- internals (callers hold the lock) -------------------------------------------------

    def _present(self, name: str, source: str, dtype: str | None = None) -> ModelRecord | None:
        try:
            rec = self.get(name)
        except (ModelNotFound, ArtifactInvalid):
            return None
        try:
            size_ok = rec.artifact_path.stat().st_size == rec.manifest.size_bytes
        except OSError:
            return None
        tok_ok = rec.tokenizer_path is None or rec.tokenizer_path.is_file()
        dtype_ok = dtype is None or rec.manifest.dtype == dtype
        return rec if rec.manifest.source == source and size_ok and tok_ok and dtype_ok else None

    def _discard(self, name: str) -> None:
        if (self.root / name).exists():
            grave = Path(tempfile.mkdtemp(prefix=".rm-", dir=self.root))
            os.replace(self.root / name, grave / name)
            shutil.rmtree(grave, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove what crashed builds and removals left: only the lock holder builds, and the
        caller holds the lock, so none of it is in use."""
        for entry in self.root.iterdir():
            if entry.name.startswith((".tmp-", ".rm-")) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif not entry.name.startswith(".") and entry.is_dir():
                for leftover in entry.glob("*.tmp"):
                    leftover.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _staging(self, name: str, need_bytes: int) -> Iterator[Path]:
        """A staging dir for one build of `name`, removed unless the build published it.

        `need_bytes` is what the build will write (0: unknown, or nothing new). A disk with
        less free is refused before anything is written; a build that runs out of space
        anyway is a `StorageFull` once its partial files are gone."""
        require_space(self.root, need_bytes, repr(name), "ingest again")
        full = lambda exc: StorageFull(  # noqa: E731 - read when the build has failed
            f"the disk under {self.root} filled up while building {name!r} "
            f"({exc.strerror or exc}); nothing of it was kept, "
            f"{mib(free_bytes(self.root))} are free: free some space and ingest again"
        )
        with full_disk_as(full, self.root, need_bytes):
            staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            try:
                yield staging
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    def _publish(self, staging: Path, manifest: Manifest) -> ModelRecord:
        _write_manifest(staging, manifest)
        os.chmod(staging, 0o755)
        for f in staging.iterdir():
            fsync_file(f)
        fsync_dir(staging)
        os.replace(staging, self.root / manifest.name)
        fsync_dir(self.root)
        return ModelRecord(manifest=manifest, dir=self.root / manifest.name)

    def _publish_second_name(self, rec: ModelRecord, name: str) -> ModelRecord:
        """Publish `rec`'s files under `name` too: hard links, a copy where links fail."""
        # Hard links need no space; a copy (no links on this filesystem) that does not fit
        # still fails as StorageFull.
        with self._staging(name, 0) as staging:
            files = [ARTIFACT_FILE, ARTIFACT_FILE + ".sha256"]
            files += [rec.manifest.tokenizer] if rec.manifest.tokenizer else []
            for f in files:
                try:
                    os.link(rec.dir / f, staging / f)
                except OSError:
                    shutil.copy2(rec.dir / f, staging / f)
            manifest = msgspec.structs.replace(rec.manifest, name=name, created_at=_now())
            return self._publish(staging, manifest)

    def _build_hf(
        self,
        path: Path,
        name: str,
        dtype: Dtype,
        pooling: PoolingName | None,
        source: str,
        model_name: str | None = None,
        options: EncodeOptions | None = None,
        provenance: Provenance | None = None,
        tokens: tuple[str | None, str | None] = (None, None),
    ) -> ModelRecord:
        options = options or encode_options(path)
        # An inference-free sparse model keeps its transformer in its document route.
        body = encoder_dir(path) if sparse_source(path) is not None else path
        with self._staging(name, hf_build_bytes(body, dtype)) as staging:
            artifact = staging / ARTIFACT_FILE
            info = convert_hf_dir(
                body,
                artifact,
                dtype,
                pooling=pooling,
                name=model_name or name,
                true_token=tokens[0],
                false_token=tokens[1],
                task=options.default_prompt_name,
            )
            options = fitted(options, info.kind, info.dims)
            if info.task is not None:  # one task's adapter merged: only its prompt applies
                options = EncodeOptions(
                    {info.task: options.prompts[info.task]},
                    info.task,
                    options.matryoshka_dims,
                    options.asked,
                )
            tok_src = body / "tokenizer.json"
            tokenizer = None
            if tok_src.is_file():
                (staging / TOKENIZER_FILE).write_bytes(_cleaned_tokenizer(tok_src))
                tokenizer = TOKENIZER_FILE
            heads, outputs = _ingest_heads(path, staging) if info.kind == "embed" else ({}, [])
            digest = sha256_file(artifact)
            write_digest_file(artifact, digest)
            # One input is at most the worker's encoder batch or the trained context, as for a
            # GGUF file (Qwen3 and ModernBERT train for far longer than a batch holds).
            limit = min(info.n_ctx_train, ITEM_LIMIT)
            default = min(info.max_seq_length or limit, limit)
            manifest = Manifest(
                name=name,
                format="gguf",
                kind=info.kind,
                digest=digest,
                size_bytes=artifact.stat().st_size,
                dims=info.dims,
                n_ctx=limit,
                n_ctx_train=info.n_ctx_train,
                max_tokens=default,
                max_tokens_limit=limit,
                source=source,
                created_at=_now(),
                tokenizer=tokenizer,
                pooling=info.pooling,
                dtype=info.dtype,
                n_labels=info.n_labels or None,
                labels=info.labels,
                problem_type=info.problem_type,
                prompts=options.prompts,
                default_prompt_name=options.default_prompt_name,
                matryoshka_dims=options.matryoshka_dims,
                provenance=provenance,
                llm_rerank=info.llm_rerank,
                heads=heads,
                outputs=outputs,
            )
            return self._publish(staging, manifest)

    def _build_gemma(self, name: str, tokenizer_builder: TokenizerBuilder | None) -> ModelRecord:
        tokenizer_bytes = gemma.DERIVED_TOKENIZER_BYTES if tokenizer_builder is not None else 0
        with self._staging(name, gemma.assembled_size() + tokenizer_bytes) as staging:
            artifact = staging / ARTIFACT_FILE
            digest = gemma.assemble_gemma(artifact)
            write_digest_file(artifact, digest)
            meta = gguf_metadata(artifact)
            n_ctx_train = int(meta["context_length"])
            n_ctx = min(GEMMA_N_CTX, n_ctx_train)
            tokenizer = None
            if tokenizer_builder is not None:
                tokenizer_builder(artifact, staging / TOKENIZER_FILE)
                tokenizer = TOKENIZER_FILE
            manifest = Manifest(
                name=name,
                format="gguf",
                kind="generate",
                digest=digest,
                size_bytes=artifact.stat().st_size,
                dims=int(meta["embedding_length"]),
                n_ctx=n_ctx,
                n_ctx_train=n_ctx_train,
                max_tokens=n_ctx - GEMMA_MAX_NEW_TOKENS,
                max_tokens_limit=n_ctx - 1,
                source=gemma.source(),
                created_at=_now(),
                tokenizer=tokenizer,
                dtype="q4_k_m",
                max_new_tokens=GEMMA_MAX_NEW_TOKENS,
            )
            return self._publish(staging, manifest)

    def _derive_tokenizer(
        self, rec: ModelRecord, builder: TokenizerBuilder, need_bytes: int
    ) -> ModelRecord:
        return self._replace_tokenizer(rec, lambda tmp: builder(rec.artifact_path, tmp), need_bytes)

    def _replace_tokenizer(
        self, rec: ModelRecord, write: Callable[[Path], object], need_bytes: int
    ) -> ModelRecord:
        """`write` the new tokenizer.json beside the old one, then swap it in and rewrite the
        manifest. A failure (a full disk: `StorageFull`) leaves the model as it was: writes
        only go to temp files, and a manifest that already names tokenizer.json is not
        rewritten, so a manifest write that fails leaves a tokenizer the manifest ignores.
        `need_bytes`, what `write` writes, is checked against the free space before anything
        is written."""
        require_space(
            self.root, need_bytes, f"{rec.name!r}'s tokenizer", "try again (the model is as it was)"
        )
        tmp = rec.dir / (TOKENIZER_FILE + ".tmp")
        manifest = msgspec.structs.replace(rec.manifest, tokenizer=TOKENIZER_FILE)
        full = lambda exc: StorageFull(  # noqa: E731
            f"no space left under {self.root} to write {rec.name!r}'s tokenizer "
            f"({exc.strerror or exc}); the model is as it was: free some space and try again"
        )
        with full_disk_as(full, self.root):
            try:
                write(tmp)
                fsync_file(tmp)
                os.replace(tmp, rec.dir / TOKENIZER_FILE)
                if manifest != rec.manifest:
                    _write_manifest(rec.dir, manifest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                (rec.dir / (MANIFEST_FILE + ".tmp")).unlink(missing_ok=True)
                raise
        return ModelRecord(manifest=manifest, dir=rec.dir)


def link_artifact(src: Path, artifact: Path) -> str:
    """Make `artifact` name `src`'s bytes without a second copy: a hard link where both are
    on one filesystem, else a symbolic link to its absolute path. Which one it made."""
    try:
        os.link(src, artifact)
        return "hard link"
    except OSError:  # EXDEV (another filesystem), EPERM, EMLINK: a reference instead
        os.symlink(src.resolve(), artifact)
        return "reference"


def hf_build_bytes(model_dir: Path, dtype: Dtype) -> int:
    """About what converting `model_dir` at `dtype` writes (0 when its weights cannot be read:
    the conversion then says why)."""
    try:
        elements = weight_elements(model_dir)
    except ArtifactInvalid:
        return 0
    tokenizer = model_dir / "tokenizer.json"
    tok_bytes = tokenizer.stat().st_size if tokenizer.is_file() else 0
    return elements * (2 if dtype == "f16" else 4) + tok_bytes + GGUF_OVERHEAD_BYTES


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"invalid model name {name!r}: lowercase letters, digits, '.', '_', '-' (max 64)"
        )


def _write_manifest(mdir: Path, manifest: Manifest) -> None:
    tmp = mdir / (MANIFEST_FILE + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
    fsync_file(tmp)
    os.replace(tmp, mdir / MANIFEST_FILE)
    fsync_dir(mdir)


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Scalar metadata of a GGUF, `<arch>.` prefix stripped, plus `architecture`."""
    hdr = read_header(path)
    arch = hdr.architecture
    if not arch:
        raise ArtifactInvalid(f"{path} has no general.architecture")
    meta: dict[str, Any] = {"architecture": arch}
    for key, value in hdr.kv.items():
        if key.startswith(arch + ".") and not isinstance(value, ArrayInfo):
            meta[key[len(arch) + 1 :]] = value
    return meta

"""The owned Core ML model format: a Hugging Face directory (or, for a model that has only
one, a GGUF file's f16/f32 tensors: `formats.owned.manifest_gguf`) ingested once into

    <artifact>/manifest.json        what the graph builder needs, and digests of everything
    <artifact>/weights.safetensors  the tensors the head uses, canonical names, float32
    <artifact>/tokenizer.json       copied verbatim (the host tokenizes with it)

`manifest_digest` is the sha256 of the canonical JSON of the manifest body (sorted keys, no
whitespace, UTF-8): it covers the model config, the head and the sha256 of every tensor and of
the tokenizer, so two artifacts with the same digest build the same graph. It is what HELLO
advertises, what LOAD's `artifact_digest` must equal, and the first field of a compile-cache key.

`load_manifest` re-verifies the body digest, the tokenizer and every tensor digest, and raises a
typed `ManifestError` (code `artifact_invalid`) on any mismatch: a worker never builds a graph
from weights other than the ones the digest names. The source directory's config.json is read
by `formats.hf_config` and every safetensors file by `formats.safetensors_io`; their errors are
`common.errors.ArtifactInvalid`s (`HfConfigInvalid`, `SafetensorsInvalid`), and a damaged
artifact's weights are said as a `ManifestError`, the error the worker answers LOAD with.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import numpy as np
from safetensors.numpy import save_file

from common.errors import ArtifactInvalid
from formats.digest import sha256_file
from formats.hf_config import HfConfig
from formats.owned.model import (
    DEFAULT_ARCHITECTURE,
    FAMILY_BY_ARCHITECTURE,
    Head,
    ManifestError,
    ModelConfig,
    UnsupportedModel,
    WeightDigestMismatch,
    classifier_layers,
    read_json,
    required_tensors,
    source_layout,
)
from formats.safetensors_io import SINGLE_FILE, read_safetensors

FORMAT = "coreml-owned"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "weights.safetensors"
TOKENIZER_NAME = "tokenizer.json"

# ---- manifest body -------------------------------------------------------------------------


class FileRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    file: str
    sha256: str


class TensorRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    sha256: str


class ManifestBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    format_version: int
    config: ModelConfig
    head: Head
    tokenizer: FileRecord
    weights_file: str  # safetensors; integrity is per tensor (`tensors`)
    tensors: dict[str, TensorRecord]


class Manifest(msgspec.Struct, frozen=True):
    """A verified manifest and where its artifact lives."""

    dir: str
    digest: str
    body: ManifestBody

    @property
    def config(self) -> ModelConfig:
        return self.body.config

    @property
    def head(self) -> Head:
        return self.body.head

    @property
    def weights_path(self) -> Path:
        return Path(self.dir) / self.body.weights_file

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.dir) / self.body.tokenizer.file

    def load_weights(self, verify: bool = True) -> dict[str, np.ndarray]:
        """Every tensor, float32, re-checked against its digest unless `verify=False`."""
        return _read_tensors(self.weights_path, self.body.tensors if verify else None)


def canonical_json(obj: object) -> bytes:
    return json.dumps(
        msgspec.to_builtins(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def digest_of(body: ManifestBody) -> str:
    return hashlib.sha256(canonical_json(body)).hexdigest()


# ---- ingest ----------------------------------------------------------------------------------


def _canonical_name(name: str) -> str:
    # HF BertForSequenceClassification nests the encoder under "bert." (XLM-RoBERTa's under
    # "roberta."); the original TF port names LayerNorm parameters gamma/beta.
    for prefix in ("bert.", "roberta."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    if name.endswith("LayerNorm.gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[: -len("beta")] + "bias"
    return name


def _config_from_hf(src: Path, cfg: HfConfig) -> ModelConfig:
    model_type = cfg.model_type
    arch = (cfg.architectures or [DEFAULT_ARCHITECTURE.get(model_type, "?")])[0]
    if model_type not in DEFAULT_ARCHITECTURE or FAMILY_BY_ARCHITECTURE.get(arch) != model_type:
        raise UnsupportedModel(
            f"model_type={model_type!r} / {arch}: BERT or XLM-RoBERTa "
            f"only ({', '.join(sorted(FAMILY_BY_ARCHITECTURE))})"
        )
    act = cfg.string("hidden_act")
    if act != "gelu":
        raise UnsupportedModel(f"hidden_act={act!r}: exact (erf) GELU only")
    if cfg.string("position_embedding_type") != "absolute":
        raise UnsupportedModel("only absolute position embeddings are implemented")
    # transformers' default pad id: XLM-RoBERTa's 1, BERT's 0 (formats.hf_config).
    pad = cfg.value("pad_token_id")
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise UnsupportedModel(f"pad_token_id={pad!r}: not a token id")
    rows = cfg.positive_int("max_position_embeddings")
    # Positions the graph can serve: the table's rows after XLM-RoBERTa's offset rows
    # (514 rows serve 512 tokens), every row for BERT.
    max_pos = rows - (pad + 1 if model_type == "xlm-roberta" else 0)
    if max_pos < 1:
        raise UnsupportedModel(
            f"max_position_embeddings={rows} leaves no position after the {pad + 1} offset rows"
        )
    max_seq = source_layout(src).max_seq_length or max_pos
    config = ModelConfig(
        architecture=arch,
        vocab_size=cfg.positive_int("vocab_size"),
        hidden_size=cfg.positive_int("hidden_size"),
        num_layers=cfg.positive_int("num_hidden_layers"),
        num_heads=cfg.positive_int("num_attention_heads"),
        intermediate_size=cfg.positive_int("intermediate_size"),
        max_positions=max_pos,
        type_vocab_size=cfg.positive_int("type_vocab_size"),
        layer_norm_eps=cfg.number("layer_norm_eps"),
        hidden_act="gelu",
        pad_token_id=pad,
        max_seq_length=min(max_seq, max_pos),
    )
    if config.hidden_size % config.num_heads:
        raise UnsupportedModel("hidden_size is not a multiple of num_attention_heads")
    if not 1 <= config.type_vocab_size <= 2:
        # The graph adds token types arithmetically (type 0 + tt * (type 1 - type 0)).
        raise UnsupportedModel(f"type_vocab_size={config.type_vocab_size}: 1 or 2 supported")
    return config


def _head_from_hf(src: Path, cfg: HfConfig, config: ModelConfig) -> Head:
    if config.is_cross_encoder:
        labels = len(cfg.labels())
        return Head(type="cross_encoder", pooling="cls", normalize=False, num_labels=labels)
    layout = source_layout(src)
    # What the graph computes after the encoder is one pooling of every token, prompt
    # included, then (optionally) L2: a Dense projection or a pooling that leaves the prompt
    # out would be served silently wrong, so they are refused. Dense modules with no Pooling
    # before them project every token: a multi-vector model's head, built into the graph
    # from the heads/ files ingest wrote (the artifact is its encoder alone).
    if layout.dense_dirs and layout.pooling_modes:
        raise UnsupportedModel(f"{len(layout.dense_dirs)} Dense module(s) after pooling: not built")
    if not layout.include_prompt:
        raise UnsupportedModel(
            "include_prompt=false (pooling without the prompt's tokens): not built"
        )
    if layout.pooling_modes == ("cls",):
        return Head(type="embed_cls", pooling="cls", normalize=layout.normalize, num_labels=0)
    if layout.pooling_modes not in ((), ("mean",)):
        raise UnsupportedModel(
            f"pooling {list(layout.pooling_modes)}: mean or cls pooling is built"
        )
    return Head(type="embed_mean", pooling="mean", normalize=layout.normalize, num_labels=0)


def tensor_digest(arr: np.ndarray) -> str:
    """sha256 of the tensor's little-endian bytes in C order (dtype and shape are recorded
    beside it)."""
    data = np.ascontiguousarray(arr)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    return hashlib.sha256(data.data.cast("B")).hexdigest()


def _load_hf_tensors(src: Path, wanted: list[str]) -> dict[str, np.ndarray]:
    path = src / SINGLE_FILE
    if not path.exists():
        raise ManifestError(f"{src}: no model.safetensors")
    out: dict[str, np.ndarray] = {}
    for name, arr in read_safetensors(path).items():
        canon = _canonical_name(name)
        if canon in wanted:
            out[canon] = np.ascontiguousarray(arr, dtype=np.float32)
    missing = [n for n in wanted if n not in out]
    if missing:
        raise ManifestError(f"model.safetensors lacks {missing[:3]} ({len(missing)} missing)")
    return out


def _check_shapes(config: ModelConfig, head: Head, t: dict[str, np.ndarray]) -> None:
    h, inter = config.hidden_size, config.intermediate_size
    expect = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (config.max_positions + config.position_offset, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "encoder.layer.0.intermediate.dense.weight": (inter, h),
        "encoder.layer.0.output.dense.weight": (h, inter),
    }
    if head.type == "cross_encoder":
        expect[f"{classifier_layers(config)[1]}.weight"] = (head.num_labels, h)
    for name, shape in expect.items():
        if t[name].shape != shape:
            raise ManifestError(f"{name}: shape {t[name].shape}, config implies {shape}")


def build_body(
    src_dir: str | os.PathLike[str],
    *,
    true_token: str | int | None = None,
    false_token: str | int | None = None,
) -> tuple[ManifestBody, dict[str, np.ndarray]]:
    """The manifest body and canonical tensors of a HF directory (nothing written).
    `true_token` / `false_token` name a causal LM reranker's two answer tokens (strings or
    ids; `formats.owned.rank_head`)."""
    src = Path(src_dir)
    tok = src / TOKENIZER_NAME
    cfg = HfConfig.read(src)
    if cfg.model_type == "qwen3":
        if not tok.exists():
            raise ManifestError(f"{src}: no tokenizer.json (the host tokenizes with it)")
        from formats.owned.manifest_qwen3 import config_head_tensors  # its own config and names

        config, head, tensors = config_head_tensors(src, cfg, true_token, false_token)
    elif cfg.model_type == "nomic_bert":
        from formats.owned.manifest_nomic import config_from_hf, load_tensors  # its own names

        config, sizes = config_from_hf(src, cfg)
        head = _head_from_hf(src, cfg, config)  # pooled as BERT's embedders are
        if not tok.exists():
            raise ManifestError(f"{src}: no tokenizer.json (the host tokenizes with it)")
        tensors = load_tensors(src, sizes)
    else:
        if true_token is not None or false_token is not None:
            raise UnsupportedModel(
                f"model_type={cfg.model_type!r}: true/false tokens score a causal LM "
                "reranker (Qwen3ForCausalLM)"
            )
        config = _config_from_hf(src, cfg)
        head = _head_from_hf(src, cfg, config)
        if not tok.exists():
            raise ManifestError(f"{src}: no tokenizer.json (the host tokenizes with it)")
        tensors = _load_hf_tensors(src, required_tensors(config, head))
        _check_shapes(config, head, tensors)
    return body_of(config, head, tensors, tok), tensors


def body_of(
    config: ModelConfig, head: Head, tensors: dict[str, np.ndarray], tokenizer: Path
) -> ManifestBody:
    """The manifest body naming `config`, `head`, every tensor's digest and the tokenizer's."""
    records = {
        name: TensorRecord(dtype="float32", shape=list(arr.shape), sha256=tensor_digest(arr))
        for name, arr in sorted(tensors.items())
    }
    return ManifestBody(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        config=config,
        head=head,
        tokenizer=FileRecord(file=TOKENIZER_NAME, sha256=sha256_file(tokenizer)),
        weights_file=WEIGHTS_NAME,
        tensors=records,
    )


def ingest_owned(
    src: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    pooling: str | None = None,
    max_seq_length: int | None = None,
    true_token: str | int | None = None,
    false_token: str | int | None = None,
) -> Manifest:
    """Ingest a HF BERT, XLM-RoBERTa, NomicBERT or Qwen3 directory, or a GGUF file of BERT,
    XLM-RoBERTa or Qwen3, into the owned format at `out_dir` (atomically: built in a sibling
    temp dir, then renamed). An existing artifact at `out_dir` with the same digest is
    verified and reused; anything else already there is an error.

    `true_token` / `false_token` (a directory only) make a Qwen3ForCausalLM directory a
    reranker scored with those two tokens, as a user names them at ingest; a directory that
    says it is one (a CrossEncoder ending in LogitScore, a Qwen3-Reranker) needs neither.

    A GGUF holds no tokenizer.json and need not state its pooling or default truncation: the
    caller gives the tokenizer the host serves it with (`tokenizer`) and what the model's
    record says (`pooling`, `max_seq_length`); see `formats.owned.manifest_gguf`."""
    path = Path(src)
    if path.is_file():
        from formats.owned.manifest_gguf import config_head_tensors  # GGUF names and metadata

        if true_token is not None or false_token is not None:
            # llama.cpp's converter kept the two rows, not the vocabulary they came from.
            raise ManifestError(f"{path.name}: a GGUF reranker's two rows are its cls.output")
        if tokenizer is None:
            raise ManifestError(
                f"{path.name}: a GGUF source needs the tokenizer.json the host tokenizes it with"
            )
        tok = Path(tokenizer)
        if not tok.is_file():
            raise ManifestError(f"{tok}: no such tokenizer.json")
        config, head, tensors = config_head_tensors(
            path, pooling=pooling, max_seq_length=max_seq_length
        )
        body = body_of(config, head, tensors, tok)
    else:
        if tokenizer is not None or pooling is not None or max_seq_length is not None:
            raise ManifestError(
                f"{path}: a Hugging Face directory states its own tokenizer, pooling and truncation"
            )
        body, tensors = build_body(path, true_token=true_token, false_token=false_token)
        tok = path / TOKENIZER_NAME
    return _publish(body, tensors, tok, Path(out_dir))


def _publish(
    body: ManifestBody, tensors: dict[str, np.ndarray], tokenizer: Path, out: Path
) -> Manifest:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights = tmp / WEIGHTS_NAME
        save_file(tensors, str(weights), metadata={"format": FORMAT})
        shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        digest = digest_of(body)
        doc = msgspec.to_builtins(body) | {"manifest_digest": digest}
        (tmp / MANIFEST_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        for p in (weights, tmp / TOKENIZER_NAME, tmp / MANIFEST_NAME):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if out.exists() and any(out.iterdir()):
            existing = load_manifest(out)
            if existing.digest != digest:
                raise ManifestError(f"{out} holds another artifact ({existing.digest[:12]})")
            return existing
        # mkdtemp and safetensors create owner-only modes; an artifact is plain readable data.
        os.chmod(tmp, 0o755)
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_manifest(out, verify_weights=False)  # just written from verified tensors


# ---- load and verify -------------------------------------------------------------------------


def _read_tensors(path: Path, records: dict[str, TensorRecord] | None) -> dict[str, np.ndarray]:
    try:
        tensors = read_safetensors(path)
    except ArtifactInvalid as e:  # damaged weights are a damaged artifact, said as one
        raise ManifestError(e.message) from e
    names = set(tensors)
    if records is not None and names != set(records):
        extra, missing = sorted(names - set(records)), sorted(set(records) - names)
        raise ManifestError(
            f"weights: tensors differ from manifest (extra {extra[:3]}, missing {missing[:3]})"
        )
    out: dict[str, np.ndarray] = {}
    for name in sorted(names):
        arr = tensors[name]
        if records is not None:
            rec = records[name]
            if str(arr.dtype) != rec.dtype or list(arr.shape) != rec.shape:
                raise ManifestError(
                    f"tensor {name!r}: {arr.dtype}{list(arr.shape)} "
                    f"!= manifest {rec.dtype}{rec.shape}"
                )
            actual = tensor_digest(arr)
            if actual != rec.sha256:
                raise WeightDigestMismatch(name, rec.sha256, actual)
        out[name] = arr.astype(np.float32, copy=False)
    return out


_body_decoder = msgspec.json.Decoder(ManifestBody)


def load_manifest(dir: str | os.PathLike[str], *, verify_weights: bool = True) -> Manifest:
    """Read and verify `<dir>/manifest.json`: body digest, tokenizer digest and (unless
    `verify_weights=False`) every tensor's digest. Raises `ManifestError` subclasses."""
    d = Path(dir)
    raw = read_json(d / MANIFEST_NAME)
    if not isinstance(raw, dict):
        raise ManifestError(f"{MANIFEST_NAME}: expected a JSON object, got {type(raw).__name__}")
    stored = raw.pop("manifest_digest", None)
    try:
        body = _body_decoder.decode(json.dumps(raw))
    except msgspec.ValidationError as e:
        raise ManifestError(f"manifest.json: {e}") from e
    if body.format != FORMAT or body.format_version != FORMAT_VERSION:
        raise ManifestError(
            f"format {body.format!r} v{body.format_version}: expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    digest = digest_of(body)
    if stored != digest:
        raise ManifestError(
            f"manifest_digest {str(stored)[:16]}... does not match its body ({digest[:16]}...)"
        )
    manifest = Manifest(dir=str(d.absolute()), digest=digest, body=body)
    tok = manifest.tokenizer_path
    try:
        tok_ok = tok.is_file() and sha256_file(tok) == body.tokenizer.sha256
    except OSError as e:  # unreadable: as damaged as a wrong digest
        raise ManifestError(f"{body.tokenizer.file}: {e}") from e
    if not tok_ok:
        raise ManifestError(f"{body.tokenizer.file}: missing or digest mismatch")
    if not manifest.weights_path.exists():
        raise ManifestError(f"{body.weights_file}: missing")
    if verify_weights:
        _read_tensors(manifest.weights_path, body.tensors)
    return manifest

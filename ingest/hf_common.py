"""What every Hugging Face family converter shares: the result it reports, the
sentence-transformers facts it reads, and the atomic GGUF write with llama.cpp's dtype rule.

Each family converter (`ingest.bert_to_gguf` for BERT and XLM-RoBERTa, `ingest.hf_qwen3`,
`ingest.hf_modernbert`, `ingest.hf_gemma3`) is `convert(model_dir, config, out_path, dtype,
pooling, name) -> ConvertedModel`; `ingest.hf_dir` picks one by `config.json`'s `model_type`.
`config` is the directory's `formats.hf_config.HfConfig` (the one reader of config.json, which
the owned Core ML manifest reads too) and the weights come from `formats.safetensors_io`.
They are the project's own (numpy + safetensors + the pinned `gguf` package's tensor names),
not llama.cpp's `convert_hf_to_gguf.py`: that script imports torch and transformers (several GB
a serving machine does not otherwise need) and is not shipped in any wheel. Tests prove each
converter against transformers / sentence-transformers on models built here.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import gguf
import msgspec
import numpy as np

from common.errors import ArtifactInvalid, InvalidRequest
from formats.st_layout import Layout, LayoutError, read_layout
from ingest.llm_rerank import LlmRerankSpec

Dtype = Literal["f32", "f16"]
PoolingName = Literal["mean", "cls", "last", "rank"]
POOLING_TYPES = {
    "mean": gguf.PoolingType.MEAN,
    "cls": gguf.PoolingType.CLS,
    "last": gguf.PoolingType.LAST,
    "rank": gguf.PoolingType.RANK,
}
# sentence-transformers' pooling modes -> llama.cpp's (the ones it computes).
ST_TO_LLAMA_POOLING: dict[str, PoolingName] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}


class ConvertedModel(msgspec.Struct, frozen=True):
    """What a converter learned; the store turns it into a manifest."""

    kind: Literal["embed", "rerank"]
    dtype: Dtype
    dims: int  # the width of the served vector (after any Dense projection)
    pooling: PoolingName
    n_ctx_train: int  # the most positions the model was trained for (llama.cpp's limit)
    vocab_size: int
    n_layers: int
    n_labels: int  # classifier outputs (0 for embedders)
    cls_id: int | None
    sep_id: int | None
    max_seq_length: int | None  # sentence-transformers' trained sequence length, if any
    architecture: str = "bert"  # general.architecture of the GGUF written
    # A sequence classifier's label names by id and `problem_type` (ingest.hf_dir fills them
    # from config.json for every family, so converters need not).
    labels: list[str] = []
    problem_type: str | None = None
    # An LLM reranker's template and scored tokens (ingest.llm_rerank), None otherwise.
    llm_rerank: LlmRerankSpec | None = None
    # The task whose adapter was merged into the weights (jina-embeddings-v3): the model
    # serves that task alone, so only its prompt is kept (ingest.hf_jina_v3).
    task: str | None = None


def load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ArtifactInvalid(f"missing {path.name} in {path.parent}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactInvalid(f"unreadable {path}: {e}") from e


def st_layout(model_dir: Path) -> Layout:
    try:
        return read_layout(model_dir)
    except LayoutError as e:
        raise ArtifactInvalid(str(e)) from e


def st_pooling(model_dir: Path) -> PoolingName | None:
    """Pooling declared by a sentence-transformers Pooling module (either layout), if any."""
    mode = st_layout(model_dir).pooling
    if mode is None:
        return None
    if mode not in ST_TO_LLAMA_POOLING:
        raise ArtifactInvalid(
            f"unsupported sentence-transformers pooling {mode!r} (mean/cls/lasttoken only)"
        )
    return ST_TO_LLAMA_POOLING[mode]


def check_request(dtype: str, pooling: str | None) -> None:
    if dtype not in ("f32", "f16"):
        raise InvalidRequest(f"dtype must be 'f32' or 'f16', not {dtype!r}")
    if pooling is not None and pooling not in POOLING_TYPES:
        raise InvalidRequest(f"pooling must be one of {sorted(POOLING_TYPES)}, not {pooling!r}")


def embed_pooling(model_dir: Path, pooling: PoolingName | None) -> PoolingName:
    """An embedder's pooling: the caller's, else the directory's; never guessed."""
    if pooling == "rank":
        raise InvalidRequest("rank pooling needs a sequence-classification model")
    pooling = pooling or st_pooling(model_dir)
    if pooling is None:
        raise InvalidRequest(f"{model_dir} declares no pooling; pass pooling=")
    return pooling


def positive_ints(config: dict, keys: Iterable[str]) -> None:
    """Positive integers of a sentence-transformers module's config.json (the model's own
    config.json is `formats.hf_config`'s)."""
    for key in keys:
        if (
            not isinstance(config.get(key), int)
            or isinstance(config[key], bool)
            or config[key] <= 0
        ):
            raise ArtifactInvalid(f"config.json: {key} missing or not a positive integer")


def tensor_dtype(name: str, arr: np.ndarray, dtype: Dtype, keep_f32: bool = False) -> type:
    """llama.cpp's converter rule: 1-D tensors and norms stay f32 (its kernels want f32 there);
    matrices take the file's dtype."""
    if dtype == "f32" or keep_f32 or arr.ndim <= 1 or name.endswith("_norm.weight"):
        return np.float32
    return np.float16


def write_gguf(out_path: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> None:
    """Write a GGUF of `arch` whose keys and tensors `fill` adds; atomically (temp file in the
    same directory, fsync, rename), so a failed conversion leaves nothing at `out_path`."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".convert-", suffix=".gguf", dir=out_path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:  # durable before the rename publishes it
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are ordinary cache files
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_type(dtype: Dtype) -> int:
    return int(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)


def map_names(
    weights: dict[str, np.ndarray],
    arch: gguf.MODEL_ARCH,
    n_layers: int,
    ignored: Callable[[str], bool],
) -> dict[str, np.ndarray]:
    """HF tensor names -> llama.cpp's, through the pinned gguf package's own map for `arch`
    (never spelled by hand). A tensor neither mapped nor `ignored` is refused, named: loading
    a model with a part we silently dropped would compute something else."""
    table = gguf.get_tensor_name_map(arch, n_layers)
    out: dict[str, np.ndarray] = {}
    for key, arr in weights.items():
        if ignored(key):
            continue
        # With try_suffixes the map keeps the key's own ".weight" / ".bias" on the name.
        full = table.get_name(key, try_suffixes=(".weight", ".bias"))
        if full is None:
            raise ArtifactInvalid(f"unexpected tensor {key!r}")
        if full in out:
            raise ArtifactInvalid(f"two tensors map to {full!r} (one is {key!r})")
        out[full] = arr
    return out


def require(tensors: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every named tensor is present with the shape config.json implies."""
    for name, shape in shapes.items():
        if name not in tensors:
            raise ArtifactInvalid(f"missing tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise ArtifactInvalid(
                f"{name} has shape {tuple(tensors[name].shape)}, config.json says {shape}"
            )


def tensor_name(arch: gguf.MODEL_ARCH, t: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
    """llama.cpp's name of tensor `t` (of block `bid`) in `arch`, from `gguf.constants`; the
    assertion stops a gguf upgrade that renamed or dropped one of the arch's tensors."""
    assert t in gguf.MODEL_TENSORS[arch], t
    base = gguf.TENSOR_NAMES[t]
    return base.format(bid=bid) if bid is not None else base

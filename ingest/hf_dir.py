"""A Hugging Face / sentence-transformers directory -> GGUF, by its `config.json` `model_type`.

config.json is read once (`formats.hf_config`) and handed to the family's converter. One
converter per family (see `ingest.hf_common` for what they share and why they are our
own). A directory of any other family is refused, naming its model_type and the ones we read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from common.errors import ArtifactInvalid
from formats.hf_config import HfConfig
from ingest import bert_to_gguf, hf_gemma3, hf_modernbert, hf_nomic_bert, hf_qwen3
from ingest.hf_common import ConvertedModel, Dtype, PoolingName, check_request

Converter = Callable[[Path, HfConfig, Path, Dtype, "PoolingName | None", str], ConvertedModel]

FAMILIES: dict[str, Converter] = {
    "bert": bert_to_gguf.convert,
    "xlm-roberta": bert_to_gguf.convert,
    "modernbert": hf_modernbert.convert,
    "nomic_bert": hf_nomic_bert.convert,
    "gemma3_text": hf_gemma3.convert,
    "qwen3": hf_qwen3.convert,
}


def convert_hf_dir(
    model_dir: str | Path,
    out_path: str | Path,
    dtype: Dtype = "f16",
    *,
    pooling: PoolingName | None = None,
    name: str | None = None,
) -> ConvertedModel:
    """Convert `model_dir` to a GGUF at `out_path` (atomically). `pooling` overrides what the
    directory declares; an embedder that declares none must be given one. Raises
    ArtifactInvalid / InvalidRequest."""
    check_request(dtype, pooling)
    model_dir, out_path = Path(model_dir), Path(out_path)
    if not model_dir.is_dir():
        raise ArtifactInvalid(f"{model_dir} is not a directory")
    config = HfConfig.read(model_dir)
    model_type = config.model_type
    convert = FAMILIES.get(model_type)
    if convert is None:
        raise ArtifactInvalid(
            f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(FAMILIES))})"
        )
    info = convert(model_dir, config, out_path, dtype, pooling, name or model_dir.name)
    if info.kind != "rerank":
        return info
    # What the host scores a classifier's labels with (service/predict.py): their names, by
    # id as the GGUF's classifier.output_labels holds them, and the activation's problem type.
    return msgspec.structs.replace(info, labels=config.labels(), problem_type=config.problem_type())

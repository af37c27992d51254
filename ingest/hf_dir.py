"""A Hugging Face / sentence-transformers directory -> GGUF, by its `config.json` `model_type`.

config.json is read once (`formats.hf_config`) and handed to the family's converter. One
converter per family (see `ingest.hf_common` for what they share and why they are our
own). A directory of any other family is refused, naming its model_type and the ones we read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from ingest import bert_to_gguf, hf_gemma3, hf_jina_v3, hf_modernbert, hf_nomic_bert, hf_qwen3
from ingest.hf_common import ConvertedModel, Dtype, PoolingName, check_request, st_layout
from ingest.llm_rerank import LLM_RERANK_FAMILIES, is_llm_reranker, spec_from_hf_dir

Converter = Callable[[Path, HfConfig, Path, Dtype, "PoolingName | None", str], ConvertedModel]

FAMILIES: dict[str, Converter] = {
    "bert": bert_to_gguf.convert,
    "xlm-roberta": bert_to_gguf.convert,
    "modernbert": hf_modernbert.convert,
    "nomic_bert": hf_nomic_bert.convert,
    "gemma3_text": hf_gemma3.convert,
    "qwen3": hf_qwen3.convert,
    hf_jina_v3.MODEL_TYPE: hf_jina_v3.convert,
}


def convert_hf_dir(
    model_dir: str | Path,
    out_path: str | Path,
    dtype: Dtype = "f16",
    *,
    pooling: PoolingName | None = None,
    name: str | None = None,
    true_token: str | None = None,
    false_token: str | None = None,
    task: str | None = None,
) -> ConvertedModel:
    """Convert `model_dir` to a GGUF at `out_path` (atomically). `task`: the adapter a
    jina-embeddings-v3 checkpoint is served with (ingest.hf_jina_v3). `pooling` overrides what the
    directory declares; an embedder that declares none must be given one. A `...ForCausalLM`
    directory that is an LLM reranker (ingest.llm_rerank) is converted as one, scoring
    `true_token` against `false_token` when given. Raises ArtifactInvalid / InvalidRequest."""
    check_request(dtype, pooling)
    model_dir, out_path = Path(model_dir), Path(out_path)
    if not model_dir.is_dir():
        raise ArtifactInvalid(f"{model_dir} is not a directory")
    config = HfConfig.read(model_dir)
    model_type = config.model_type
    if is_llm_reranker(model_dir, config):
        return _convert_reranker(
            model_dir, config, out_path, dtype, pooling, name, true_token, false_token
        )
    if true_token is not None or false_token is not None:
        raise InvalidRequest("--true-token/--false-token name an LLM reranker's scored tokens")
    if hf_jina_v3.is_jina_v3(config):
        # Before the family table: the Hub's checkpoint says model_type xlm-roberta.
        return hf_jina_v3.convert(
            model_dir, config, out_path, dtype, pooling, name or model_dir.name, task=task
        )
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


def _convert_reranker(
    model_dir: Path,
    config: HfConfig,
    out_path: Path,
    dtype: Dtype,
    pooling: PoolingName | None,
    name: str | None,
    true_token: str | None,
    false_token: str | None,
) -> ConvertedModel:
    if config.model_type not in LLM_RERANK_FAMILIES:
        raise ArtifactInvalid(
            f"LLM reranker of model_type {config.model_type!r} is not served (LLM rerankers: "
            f"{', '.join(sorted(LLM_RERANK_FAMILIES))})"
        )
    if pooling not in (None, "rank"):
        raise InvalidRequest("an LLM reranker scores its last token; it takes no pooling")
    layout = st_layout(model_dir)
    spec = spec_from_hf_dir(
        model_dir,
        true_token=true_token,
        false_token=false_token,
        instructions=layout.prompts,
        default_instruction_name=layout.default_prompt_name,
    )
    convert = (
        hf_qwen3.convert_reranker if config.model_type == "qwen3" else hf_gemma3.convert_reranker
    )
    return convert(model_dir, config, out_path, dtype, name or model_dir.name, spec)

"""Module-side artifact ingest: owned HF->GGUF conversion per family, default models, the store.

The host process imports this package; it never imports llama_cpp (engines that can abort
run in worker processes only).
"""

from ingest.bert_to_gguf import BertGGUFInfo, convert_bert_dir
from ingest.errors import ArtifactExists
from ingest.gemma import assemble_gemma
from ingest.hf_common import ConvertedModel
from ingest.hf_dir import FAMILIES, convert_hf_dir
from ingest.store import ArtifactStore, Manifest, ModelRecord, default_root

__all__ = [
    "ArtifactExists",
    "ArtifactStore",
    "BertGGUFInfo",
    "ConvertedModel",
    "FAMILIES",
    "Manifest",
    "ModelRecord",
    "assemble_gemma",
    "convert_bert_dir",
    "convert_hf_dir",
    "default_root",
]

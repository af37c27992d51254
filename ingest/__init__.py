"""Module-side artifact ingest: owned BERT->GGUF conversion, default models, the store.

The host process imports this package; it never imports llama_cpp (engines that can abort
run in worker processes only).
"""

from ingest.bert_to_gguf import BertGGUFInfo, convert_bert_dir
from ingest.errors import (
    ArtifactError,
    ArtifactExists,
    ArtifactInvalid,
    ArtifactNotFound,
    InvalidRequest,
)
from ingest.gemma import assemble_gemma
from ingest.store import ArtifactStore, Manifest, ModelRecord, default_root

__all__ = [
    "ArtifactError",
    "ArtifactExists",
    "ArtifactInvalid",
    "ArtifactNotFound",
    "ArtifactStore",
    "BertGGUFInfo",
    "InvalidRequest",
    "Manifest",
    "ModelRecord",
    "assemble_gemma",
    "convert_bert_dir",
    "default_root",
]

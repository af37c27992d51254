"""One loaded lane of a model as the Module keeps it: its record, tokenizer, supervisor and
what its worker's LOADED said."""

from __future__ import annotations

from dataclasses import dataclass

from host.chat_pairs import ChatPairs
from host.lane import Lane
from host.tokenization import Tokenizer
from ingest.store import ModelRecord
from workers.protocol import messages as m


@dataclass
class Served:
    record: ModelRecord
    tokenizer: Tokenizer
    lane: Lane
    dims: int
    lane_kind: str = "llama"
    artifact_digest: str = ""  # what LOAD verified: the GGUF sha256 or the manifest digest
    device: str = "cpu"  # what the worker's LOADED said it runs on ("cpu", "metal", "ane"...)
    chat_pairs: ChatPairs | None = None  # an LLM reranker's pair composer, built on first use
    load_extra: dict | None = None  # the runtime_config_extra LOAD was given (its identity)
    # The ENCODE outputs its worker refuses whatever the items (LOADED's declaration).
    refuses: tuple[m.Refusal, ...] = ()
    # The most tokens one item may have on this lane (LOADED's declaration; None: the model's
    # own limit).
    max_item_tokens: int | None = None

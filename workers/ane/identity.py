"""The Core ML engine's identity constants, importable without coremltools.

HELLO must go out before the heavy imports (coremltools takes seconds to import, 8-11 s with
torch installed), so everything HELLO and the compile-cache keys name lives here: the graph's
kernel revision, its precision and deployment target, and coremltools' version read from the
installed distribution's metadata instead of `coremltools.__version__`.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

#: Names the builder's graph. Bump it whenever the emitted graph changes for the same inputs:
#: it is part of every compile-cache key and of HELLO.
#: ane-bert-2: an embedder's unpacked graph also outputs every token's final state and the
#: token heads built on it (workers.ane.token_heads).
#: ane-bert-3: its packed graph too, with a key-mask input and SPLADE pooled per segment.
KERNEL_REVISION = "ane-bert-3"

#: Per model family (`ModelConfig.family`). XLM-RoBERTa's graph is BERT's with its own
#: position offset and head names, so its revision extends BERT's: a change to the shared
#: encoder renames both, a change to what only XLM-RoBERTa emits renames only its own, and
#: BERT's compiled shapes and certificates survive either way.
KERNEL_REVISIONS = {"bert": KERNEL_REVISION, "xlm-roberta": f"{KERNEL_REVISION}+xlmr-1"}
#: Qwen3 is its own graph (workers.ane.builder_qwen3), sharing no op with BERT's: its own
#: revision, bumped when that graph changes, and never equal to another family's.
KERNEL_REVISIONS["qwen3"] = "ane-qwen3-1"
#: NomicBERT (workers.ane.builder_nomic) keeps BERT's attention, masks and pooling but has
#: rotary positions, SwiGLU and no biases: its own revision, so neither family's compiled
#: shapes or certificates ever match the other's, and a change to either graph renames one.
KERNEL_REVISIONS["nomic_bert"] = "ane-nomic-bert-1"


#: A head only some models of a family have extends the family's revision, as XLM-RoBERTa's
#: extends BERT's: a change to the shared layers renames both, a change to the head renames
#: only its models', and the family's other compiled shapes and certificates survive it. The
#: Qwen3 reranker's score head (one row on the last real token) is such a head.
HEAD_REVISIONS = {("qwen3", "rank_last"): "+rank-1"}


def kernel_revision(family: str, head: str | None = None) -> str:
    """The revision of the graph a `family` model with a `head` (`Head.type`) builds."""
    return KERNEL_REVISIONS[family] + HEAD_REVISIONS.get((family, head or ""), "")


PRECISION = "fp16"
DEPLOYMENT_TARGET = "macOS14"


@functools.cache
def coremltools_version() -> str:
    try:
        return version("coremltools")
    except PackageNotFoundError:
        return "absent"

"""Shared setup for the test_ane_* modules (this module holds no tests).

Compiling a shape costs ~15 s (coremltools' pass pipeline over ~1000 ops), so every artifact,
tokenizer and compiled shape is built once per test process and shared through one compile
cache: the first test that needs a shape compiles it, later ones hit the cache. Functions are
process-cached (not session fixtures) because fixtures imported into several modules are
instantiated once per module.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import tokenizers

from certification.corpus import corpus
from certification.reference.bert import BertReference
from certification.reference.cross_encoder import build_test_cross_encoder
from formats.owned.manifest import Manifest, ingest_owned
from ingest.model_packages import minilm_dir
from workers.ane.engine import AneEngine
from workers.engine import NullProgress
from workers.protocol import messages as m

# SYNAPSE_ANE_TEST_ROOT keeps artifacts and compiled shapes between runs (local iteration);
# by default everything lives in a temp dir removed at exit.
if os.environ.get("SYNAPSE_ANE_TEST_ROOT"):
    ROOT = Path(os.environ["SYNAPSE_ANE_TEST_ROOT"])
    ROOT.mkdir(parents=True, exist_ok=True)
else:
    ROOT = Path(tempfile.mkdtemp(prefix="syn-ane-tests-"))
    atexit.register(shutil.rmtree, ROOT, True)
CACHE_ROOT = ROOT / "compile-cache"

# The shapes the tests share (each compiled once per process).
EMBED_UNPACKED = {"rows": 4, "seq_len": 256}
EMBED_PACKED = {"rows": 4, "seq_len": 256, "packed": True, "max_segments": 16}
RERANK_UNPACKED = {"rows": 4, "seq_len": 128}
RERANK_PACKED = {"rows": 2, "seq_len": 128, "packed": True, "max_segments": 8}
MAX_TOKENS = 256  # the embed shapes' seq_len: longer corpus items are truncated to it


@cache
def minilm() -> Manifest:
    return ingest_owned(minilm_dir(), ROOT / "minilm")


@cache
def cross_encoder() -> Manifest:
    src = build_test_cross_encoder(ROOT / "cross-encoder-src", seed=0)
    return ingest_owned(src, ROOT / "cross-encoder")


@cache
def minilm_reference() -> BertReference:
    return BertReference.from_dir(minilm_dir())


@cache
def cross_encoder_reference() -> BertReference:
    return BertReference.from_dir(ROOT / "cross-encoder-src")


@cache
def tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()  # MiniLM's tokenizer.json pads to 128; nothing is padded on the wire
    tok.no_truncation()
    return tok


def encode(text: str, limit: int = MAX_TOKENS) -> np.ndarray:
    ids = tokenizer().encode(text).ids
    if len(ids) > limit:
        ids = ids[: limit - 1] + ids[-1:]  # keep the final [SEP], as the host's truncation
    return np.asarray(ids, dtype=np.int32)


@cache
def embed_corpus() -> tuple[str, ...]:
    """>= 100 items: every third corpus item under 200 tokens (many languages and scripts,
    emoji, code, very short ones) plus six long paragraphs (>= 200 tokens, cut to 256). The
    fp32 reference takes ~2.5 ms per token here, so long items are kept few."""
    items = corpus()
    lengths = [len(tokenizer().encode(t).ids) for t in items]
    short = [t for i, t in enumerate(items) if i % 3 == 0 and lengths[i] < 200]
    long = [t for i, t in enumerate(items) if lengths[i] >= 200]
    return tuple(short[:100] + long[:: max(1, len(long) // 6)][:6])


def pairs() -> list[tuple[str, str]]:
    items = corpus()
    return [(items[i], items[(i * 7 + 11) % 120]) for i in range(0, 120, 5)]


def load_request(manifest: Manifest, req_id: int = 1, **config: object) -> m.LOAD:
    return m.LOAD(
        req_id=req_id,
        artifact_path=manifest.dir,
        artifact_digest=manifest.digest,
        format="coreml-owned",
        runtime_config={"cache_root": str(CACHE_ROOT), **config},
    )


def new_engine(manifest: Manifest, shapes: list[dict], **config: object) -> AneEngine:
    engine = AneEngine(manifest.dir, backend="reference")
    engine.load(load_request(manifest, shapes=shapes, **config), NullProgress())
    return engine


def model_ref(manifest: Manifest) -> str:
    return Path(manifest.dir).name


def embed_request(
    manifest: Manifest, seqs: list[np.ndarray], normalize: bool = False, req_id: int = 2
) -> tuple[m.EMBED_BATCH, np.ndarray]:
    req = m.EMBED_BATCH(
        req_id=req_id,
        model_ref=model_ref(manifest),
        items=[m.EmbedItem(id=i, n_tokens=len(s)) for i, s in enumerate(seqs)],
        normalize=normalize,
    )
    return req, np.concatenate(seqs).astype(np.int32)


def rerank_request(
    manifest: Manifest, encs: list[tokenizers.Encoding], req_id: int = 3
) -> tuple[m.RERANK_SEQUENCES, np.ndarray]:
    seqs = [m.RerankSequence(n_tokens=len(e.ids), n_first=e.type_ids.count(0)) for e in encs]
    req = m.RERANK_SEQUENCES(req_id=req_id, model_ref=model_ref(manifest), sequences=seqs)
    return req, np.concatenate([np.asarray(e.ids, np.int32) for e in encs])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))

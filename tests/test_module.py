"""The llama.cpp lane end to end through `Module`: real workers, real models, real aborts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from certification.corpus import corpus
from certification.reference.bert import BertReference
from common.errors import InvalidRequest, ModelNotFound
from host.config import HostConfig
from host.errors import EngineCrashed, WorkerError
from host.module import Module, ModuleConfig
from ingest.model_packages import minilm_dir
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM_DIR = minilm_dir()


@pytest.fixture(scope="module")
def reference_embed():
    """MiniLM's fp32 numpy forward (mean-pooled, normalized), computed once per list of ids:
    both precisions are judged on the same ids (one tokenizer), ~15 s of CPU a forward."""
    bert = BertReference.from_dir(MINILM_DIR)
    memo: dict[tuple, np.ndarray] = {}

    def embed(ids) -> np.ndarray:
        key = tuple(tuple(int(t) for t in seq) for seq in ids)
        if key not in memo:
            memo[key] = bert.embed(ids, pooling="mean", normalize=True)
        return memo[key]

    return embed


def module_config(store_root: str, runtime_dir: str, **host) -> ModuleConfig:
    return ModuleConfig(
        store_root=store_root,
        host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0, **host),
    )


# Both precisions the store holds; the default `minilm-l6-v2` is one of them (same bytes).
@pytest.mark.parametrize("model", ["minilm-l6-v2-f16", "minilm-l6-v2-f32"])
async def test_embedding_fidelity_against_the_fp32_reference(
    store_root, short_runtime_dir, reference_embed, model
):
    texts = list(corpus())[::3]  # 112 items across every category, long ones included
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        result = await mod.embed(texts, model=model)
        tokenizer = await mod.tokenizer(model)
    ids = tokenizer.encode(texts, truncate=True).ids
    assert sum(len(x) >= 200 for x in ids) >= 10 and len(texts) >= 100
    ref = reference_embed(ids)
    cos = np.sum(result.vectors * ref, axis=1)
    assert cos.min() >= 0.9999, (model, float(cos.min()), texts[int(cos.argmin())][:80])
    assert np.allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)
    assert result.usage.total_tokens == sum(len(x) for x in ids)


async def test_batching_does_not_change_vectors(store_root, short_runtime_dir):
    texts = list(corpus())[:40]
    cfg = module_config(store_root, short_runtime_dir)
    async with Module(cfg) as mod:
        together = (await mod.embed(texts)).vectors
        alone = np.stack([(await mod.embed([t])).vectors[0] for t in texts[:8]])
        mod.config.max_worker_batch_tokens = 64  # force many small EMBED_BATCH requests
        split = (await mod.embed(texts)).vectors
    # Batch composition changes llama.cpp's matmul blocking, so f16 results move in the
    # last bits; the items must not otherwise influence each other.
    assert np.abs(together[:8] - alone).max() < 5e-4
    assert np.abs(together - split).max() < 5e-4


async def test_bad_inputs_get_typed_outcomes(store_root, short_runtime_dir):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        with pytest.raises(InvalidRequest, match="must not be empty"):
            await mod.embed([])
        empty = await mod.embed([""])  # [CLS] [SEP]: a valid, if meaningless, input
        assert empty.vectors.shape == (1, 384) and empty.usage.total_tokens == 2
        long = await mod.embed(["word " * 10_000])
        assert long.truncated == [True] and long.usage.total_tokens == 256
        with pytest.raises(InvalidRequest, match="over the limit"):
            await mod.embed(["word " * 10_000], truncate=False)
        bad_utf8 = await mod.embed([b"caf\xc3 au lait \xff\xfe"])
        assert np.isfinite(bad_utf8.vectors).all()
        with pytest.raises(InvalidRequest):
            await mod.embed([123])  # type: ignore[list-item]
        with pytest.raises(ModelNotFound):
            await mod.embed(["x"], model="no-such-model")
        with pytest.raises(InvalidRequest, match="generate model"):
            await mod.embed(["x"], model="gemma3-270m")
        assert (await mod.embed(["still alive"])).vectors.shape == (1, 384)


async def test_worker_validates_ids_itself(store_root, short_runtime_dir):
    """The host validates first; the worker validates again (out-of-vocab ids)."""
    from workers.protocol import messages as m

    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load("minilm-l6-v2")
        lane = mod.supervisor("minilm-l6-v2")
        pid = lane.worker.pid
        req = m.EMBED_BATCH(
            req_id=0, model_ref="minilm-l6-v2", items=[m.EmbedItem(id=0, n_tokens=3)]
        )
        with pytest.raises(WorkerError) as info:
            await lane.request(req, np.array([101, 999_999, 102], np.int32))
        assert info.value.code == "invalid_request"
        assert lane.worker.pid == pid and lane.state().strikes == 0


async def test_real_ggml_assert_is_engine_crashed_and_the_lane_recovers(
    store_root, short_runtime_dir
):
    """With the worker's own validation switched off, an over-n_ubatch item trips a REAL
    GGML_ASSERT inside llama.cpp: the process aborts, the host reports engine_crashed with the
    assert in the log tail, and the next request runs on a fresh worker."""
    from workers.protocol import messages as m

    cfg = module_config(store_root, short_runtime_dir)
    async with Module(cfg) as mod:
        await mod.load("minilm-l6-v2")
        lane = mod.supervisor("minilm-l6-v2")
        lane.config.env["SYNAPSE_LLAMA_UNSAFE_NO_VALIDATE"] = "1"
        await lane.stop()
        await lane.start()  # the fresh worker runs without validation; LOAD is replayed
        pid = lane.worker.pid
        n = 600  # over n_ubatch (512) and over BERT's 512 positions
        ids = np.full(n, 1000, np.int32)
        ids[0], ids[-1] = 101, 102
        req = m.EMBED_BATCH(
            req_id=0, model_ref="minilm-l6-v2", items=[m.EmbedItem(id=0, n_tokens=n)]
        )
        start = time.monotonic()
        with pytest.raises(EngineCrashed) as info:
            await lane.request(req, ids)
        assert time.monotonic() - start < 30
        assert "GGML_ASSERT" in info.value.log_tail
        assert info.value.code == "engine_crashed" and lane.state().strikes == 1
        result = await mod.embed(["the next request succeeds"])
        assert result.vectors.shape == (1, 384) and lane.worker.pid != pid
        assert lane.state().strikes == 0


async def test_rerank_with_the_embedding_model_is_labelled_bi_encoder(
    store_root, short_runtime_dir
):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        result = await mod.rerank(
            "where do cats sleep?",
            ["Stocks fell on Monday.", "The cat sleeps on the windowsill.", "def f(): pass"],
            top_n=2,
        )
    assert result.method == "bi-encoder-cosine"
    assert result.results[0][0] == 1  # the cat document ranks first
    assert len(result.results) == 2


# ---- generation -----------------------------------------------------------------------------

_IN_PROCESS_GREEDY = r"""
import json, sys
import llama_cpp
from workers.llama import cpu_quirks
path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
with cpu_quirks.high_level_llama_follows_policy():  # the worker's kernels
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=1,
                          flash_attn=True, verbose=False, seed=0)
out = []
for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
    if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) >= n:
        break
    out.append(tok)
print(json.dumps(llm.detokenize(out).decode("utf-8", "replace")))
"""


async def test_greedy_generation_equals_in_process_llama_cpp(store_root, short_runtime_dir):
    prompt = "The three primary colors are"
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        result = await mod.generate(prompt, max_tokens=24)
        ids = (await mod.tokenizer("gemma3-270m")).encode([prompt], truncate=False).ids[0]
    gguf = ArtifactStore(store_root).get("gemma3-270m").artifact_path
    proc = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS_GREEDY, str(gguf), json.dumps(ids.tolist()), "24"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_WAIT_POLICY": "passive"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result.text == json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.n_gen <= 24 and result.finish_reason in ("stop", "length")
    assert result.n_prompt == len(ids)


async def test_grammar_constrains_output_and_bad_grammar_is_refused(store_root, short_runtime_dir):
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        grammar = 'root ::= "answer: " ("yes" | "no") "."'
        result = await mod.generate("Is water wet?", max_tokens=16, grammar=grammar)
        assert re.fullmatch(r"answer: (yes|no)\.", result.text), result.text
        digits = await mod.generate("Count:", max_tokens=8, grammar="root ::= [0-9]+")
        assert re.fullmatch(r"[0-9]+", digits.text)
        lane = mod.supervisor("gemma3-270m")
        pid = lane.worker.pid
        for bad in ['root ::= "unterminated', "root ::= missing_rule", "no rule here"]:
            with pytest.raises(WorkerError) as info:
                await mod.generate("x", max_tokens=4, grammar=bad)
            assert info.value.code == "invalid_request"
        assert lane.worker.pid == pid  # the worker never saw llama.cpp's parser crash
        ok = await mod.generate("Say hi:", max_tokens=4)
        assert ok.n_gen >= 1
        with pytest.raises(InvalidRequest, match="max_tokens"):
            await mod.generate("x", max_tokens=65)


async def test_deadline_on_module_calls(store_root, short_runtime_dir):
    from host.errors import DeadlineExceeded

    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load("gemma3-270m")
        with pytest.raises(DeadlineExceeded):
            await mod.generate("Tell me a long story about", max_tokens=64, deadline_s=0.01)
        result = await asyncio.wait_for(mod.generate("Hello", max_tokens=4), 60)
        assert result.n_gen >= 1


# ---- cross-encoder rerank -------------------------------------------------------------------


@pytest.fixture(scope="session")
def cross_encoder(store_root, test_cross_encoder_dir) -> Path:
    """The TEST cross-encoder (MiniLM + seeded head): numerical fidelity only, no relevance."""
    path = test_cross_encoder_dir
    store = ArtifactStore(store_root)
    store.ingest_hf_dir(path, name="test-xenc-f16", dtype="f16")
    store.ingest_hf_dir(path, name="test-xenc-f32", dtype="f32")
    return path


@pytest.mark.parametrize("model", ["test-xenc-f32", "test-xenc-f16"])
async def test_rerank_fidelity_against_the_reference(
    store_root, short_runtime_dir, cross_encoder, model
):
    query = "Where do cats like to sleep?"
    docs = list(corpus())[:60:2] + ["word " * 600]  # includes one that must be truncated
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        result = await mod.rerank(query, docs, model=model)
        seg = (await mod.tokenizer(model)).rerank_segments(query, docs, truncate=True)
    assert result.method == "cross-encoder" and len(result.results) == len(docs)
    scores = dict(result.results)
    cls_id, sep_id = 101, 102
    pairs = [np.concatenate([[cls_id], seg.query, [sep_id], d, [sep_id]]) for d in seg.docs]
    first = len(seg.query) + 2  # [CLS] q [SEP]: type 0; d [SEP]: type 1, as the model trained
    ref = BertReference.from_dir(cross_encoder).score_many(
        pairs, [(np.arange(len(p)) >= first).astype(np.int64) for p in pairs]
    )
    err = np.abs(np.array([scores[i] for i in range(len(docs))]) - ref)
    # f16 weights over the 512-token truncated pair: measured 2.4e-3 (the corpus pairs: 1e-3)
    assert err.max() <= {"test-xenc-f32": 2e-3, "test-xenc-f16": 4e-3}[model], float(err.max())
    assert err.max() <= 0.02 * ref.std()  # and small against the spread of the scores
    ranked = [i for i, _ in result.results]
    assert sorted(ranked) == list(range(len(docs)))
    assert all(scores[a] >= scores[b] for a, b in zip(ranked, ranked[1:], strict=False))

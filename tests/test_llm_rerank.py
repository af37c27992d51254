"""LLM rerankers (Qwen3-Reranker: a causal decoder asked "yes" or "no") on the llama.cpp lane,
judged against sentence-transformers 6's `CrossEncoder` raw scores (`logit[yes] - logit[no]`,
`activation_fn` Identity) on a tiny seeded Qwen3ForCausalLM built here: a byte-level BPE
trained with `tokenizers` that holds `yes` and `no`, and a Qwen3-Reranker-style chat template.
Both ways in: `ingest_hf_dir` of the directory, and `ingest_gguf` of the GGUF llama.cpp's own
converter makes of it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.rerank_llm import TEMPLATE
from certification.corpus import corpus
from certification.tokenizer_proof import prove_gguf_tokenizer
from common.errors import ArtifactInvalid, InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from host.sanitize import sanitize
from ingest.store import ArtifactStore
from tests.gguf_edit import rewrite_gguf
from tests.llama_converter import Job
from tests.llama_converter import convert as llama_convert
from tests.test_hf_qwen3 import QWEN2_SPLIT, tiny_qwen3_config
from workers.protocol import messages as m

# The first test builds the model and fetches llama.cpp's converter once (pip download of the
# pinned llama-cpp-python source, cached under the Synapse cache dir afterwards).
pytestmark = [pytest.mark.model, pytest.mark.timeout(1200)]

HIDDEN = 64
MAX_SEQ = 192  # sentence-transformers' max_seq_length and the manifest's pair limit
TEXTS = [sanitize(t) for t in list(corpus())[::7]]
QUERIES = TEXTS[:3]
DOCS = TEXTS[3:11]
INSTRUCTION = "Given a question, find the passage that states the answer"
LONG = " ".join(TEXTS[:40])  # far over MAX_SEQ
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(dst: Path) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    extra = ["yes", "no", TEMPLATE] * 40
    tok.train_from_iterator(
        list(corpus()) * 2 + extra,
        trainers.BpeTrainer(
            vocab_size=900,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_SEQ,
        chat_template=TEMPLATE,
    )
    fast.save_pretrained(dst)
    return tok.get_vocab_size()


def tiny_qwen3_reranker(dst: Path) -> Path:
    """A seeded 2-layer Qwen3ForCausalLM (tied LM head, grouped heads, head_dim != hidden /
    heads) whose README names it a Qwen3-Reranker, as llama.cpp's converter detects one."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(_tokenizer(dst))).eval().save_pretrained(dst)
    (dst / "README.md").write_text("# Qwen3-Reranker-tiny\n\nA seeded test model.\n")
    return dst


@pytest.fixture(scope="module")
def model_dir(module_tmp) -> Path:
    return tiny_qwen3_reranker(module_tmp / "Qwen3-Reranker-tiny")


@pytest.fixture(scope="module")
def llama_gguf(module_tmp, model_dir) -> Path:
    out = module_tmp / "llama-converted.gguf"
    # The trained vocabulary uses Qwen2's split rule: the converter's table name for it.
    llama_convert([Job(str(model_dir), str(out), "f32", pre="qwen2")])
    return out


@pytest.fixture(scope="module")
def store(module_tmp, model_dir, llama_gguf) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(model_dir, "llmr", dtype="f32")
    s.ingest_gguf(llama_gguf, "llmr-gguf", prove=prove_gguf_tokenizer, max_tokens=MAX_SEQ)
    return s


@pytest.fixture(scope="module")
def cross_encoder(model_dir):
    import torch
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model_dir), device="cpu", activation_fn=torch.nn.Identity())


def _reference(ce, query: str, docs: list[str], instruction: str | None = None) -> np.ndarray:
    kw = {} if instruction is None else {"prompt": instruction}
    return np.asarray(ce.predict([(query, d) for d in docs], batch_size=16, **kw), np.float64)


def _module(store: ArtifactStore, runtime_dir: str) -> Module:
    return Module(
        ModuleConfig(
            store_root=str(store.root),
            host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0),
        )
    )


def _raw(result, n: int) -> np.ndarray:
    out = np.empty(n)
    for i, s in result.results:
        out[i] = s
    return out


def test_both_ways_in_make_the_same_llm_reranker(store, model_dir, llama_gguf):
    from formats.gguf_header import read_gguf_header

    hdr = read_gguf_header(llama_gguf)
    # What llama.cpp's converter writes: rank pooling, the rendered default prompt, and the
    # checkpoint's Jinja template, which is the one rendered here.
    assert hdr.arch_get("pooling_type") == 4 and "tokenizer.chat_template.rerank" in hdr.kv
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    for name in ("llmr", "llmr-gguf"):
        man = store.get(name).manifest
        spec = man.llm_rerank
        assert man.kind == "rerank" and spec is not None, name
        assert (spec.true_token, spec.false_token) == ("yes", "no")
        assert (spec.true_id, spec.false_id) == (vocab["yes"], vocab["no"])
        assert spec.chat_template == TEMPLATE and spec.message_format == "flat"
        assert man.max_tokens == MAX_SEQ


async def test_scores_are_cross_encoders_raw_scores(store, cross_encoder, short_runtime_dir):
    """Same order on every query and max |raw diff| <= 2e-2 (the certification bar), on both
    artifacts, with the default instruction and with one the request names."""
    async with _module(store, short_runtime_dir) as mod:
        worst = 0.0
        for name in ("llmr", "llmr-gguf"):
            for q in QUERIES:
                for instr in (None, INSTRUCTION):
                    got = await mod.rerank(q, DOCS, model=name, instruction=instr)
                    raw = _raw(got, len(DOCS))
                    ref = _reference(cross_encoder, q, DOCS, instr)
                    assert [i for i, _ in got.results] == list(np.argsort(-ref, kind="stable"))
                    worst = max(worst, float(np.abs(raw - ref).max()))
                    assert not any(got.truncated)
        print(f"max |raw - sentence-transformers raw| = {worst:.2e}")
        assert worst <= 2e-2
        # The instruction reaches the prompt: it moves the scores.
        a = _raw(await mod.rerank(QUERIES[0], DOCS, model="llmr"), len(DOCS))
        b = _raw(await mod.rerank(QUERIES[0], DOCS, model="llmr", instruction=INSTRUCTION), 8)
        assert np.abs(a - b).max() > 1e-2


async def test_a_pair_scores_the_same_alone_and_in_a_batch_of_16(store, short_runtime_dir):
    docs = (DOCS * 2)[:16]
    async with _module(store, short_runtime_dir) as mod:
        together = _raw(await mod.rerank(QUERIES[1], docs, model="llmr"), 16)
        for i in (0, 7, 15):
            alone = _raw(await mod.rerank(QUERIES[1], [docs[i]], model="llmr"), 1)
            assert abs(alone[0] - together[i]) <= 1e-5, (i, alone[0], together[i])


async def test_the_two_row_head_is_the_full_heads_difference(store, short_runtime_dir):
    """In one llama.cpp forward (token states and the full LM head's logits both kept), the
    worker's two-row head on the last state equals logit[yes] - logit[no] of the full head;
    the lane's scores are that same difference up to the forward's rounding (another packing
    and thread split of the same decode)."""
    import llama_cpp

    from formats.gguf_header import read_gguf_header
    from workers.llama import llm_head

    for name in ("llmr", "llmr-gguf"):
        rec = store.get(name)
        spec = rec.manifest.llm_rerank
        assert spec is not None
        async with _module(store, short_runtime_dir) as mod:
            got = _raw(await mod.rerank(QUERIES[0], DOCS[:4], model=name), 4)
            pairs = mod._chat_pairs(mod._served[name])
            ids = [pairs.ids(QUERIES[0], d, None) for d in DOCS[:4]]
        path = str(rec.artifact_path)
        direction = llm_head.score_direction(path, read_gguf_header(path))
        llm = llama_cpp.Llama(
            path,
            n_ctx=512,
            verbose=False,
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
            logits_all=True,
        )
        try:
            for i, seq in enumerate(ids):
                llm.reset()
                llm.eval(seq)
                logits = np.asarray(llm.scores[len(seq) - 1], np.float64)
                full = logits[spec.true_id] - logits[spec.false_id]
                state = llama_cpp.llama_get_embeddings_ith(llm.ctx, len(seq) - 1)
                h = np.ctypeslib.as_array(state, shape=(HIDDEN,)).astype(np.float64)
                assert abs(float(llm_head.scores(h[None], direction)[0]) - full) <= 1e-4
                assert abs(full - got[i]) <= 1e-2, (name, i, full, got[i])
        finally:
            llm.close()


async def test_truncation_cuts_the_document_and_keeps_the_suffix(store, short_runtime_dir):
    async with _module(store, short_runtime_dir) as mod:
        short = await mod.rerank(QUERIES[0], [DOCS[0]], model="llmr")
        cut = await mod.rerank(QUERIES[0], [LONG], model="llmr")
        assert cut.truncated == [True] and cut.n_tokens == [MAX_SEQ]
        pairs = mod._chat_pairs(mod._served["llmr"])
        whole = pairs.ids(QUERIES[0], LONG, None)
        kept = pairs.compose(QUERIES[0], [LONG], None, limit=MAX_SEQ, truncate=True).ids[0]
        suffix = pairs.ids(QUERIES[0], DOCS[0], None)[-8:]
        assert list(kept[-8:]) == suffix and list(whole[-8:]) == suffix
        assert list(kept[:20]) == whole[:20]  # the template and query come first, intact
        # A plain cut at the limit loses the assistant suffix, and the score moves with it.
        naive = np.asarray(whole[:MAX_SEQ], np.int32)
        lane = mod.supervisor("llmr")
        assert lane is not None
        req = m.RERANK_SEQUENCES(
            req_id=0, model_ref="llmr", sequences=[m.RerankSequence(n_tokens=MAX_SEQ, n_first=0)]
        )
        _, naive_score = await lane.request(req, naive)
        assert abs(float(naive_score[0]) - cut.results[0][1]) > 1e-2
        with pytest.raises(InvalidRequest, match="pair 0 has") as err:
            await mod.rerank(QUERIES[0], [DOCS[0], LONG][::-1], model="llmr", truncate=False)
        assert err.value.details["index"] == 0
        assert short.truncated == [False]


def test_what_ingest_refuses(module_tmp, model_dir, llama_gguf):
    store = ArtifactStore(module_tmp / "refusals")
    # No single "yes" token: refused, unless the two tokens are named.
    plain = module_tmp / "Qwen3-Reranker-no-yes"
    shutil.copytree(model_dir, plain)
    tok = json.loads((plain / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["yes\u2063"] = vocab.pop("yes")  # the vocabulary no longer holds "yes" as a token
    (plain / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidRequest, match="no single token 'yes'"):
        store.ingest_hf_dir(plain, "x", dtype="f32")
    with pytest.raises(InvalidRequest, match="no single token 'nope'"):
        store.ingest_hf_dir(model_dir, "x", dtype="f32", false_token="nope")
    two = sorted(t for t in vocab if t.isascii() and t.isalpha() and len(t) > 2)[:2]
    rec = store.ingest_hf_dir(plain, "named", dtype="f32", true_token=two[0], false_token=two[1])
    assert rec.manifest.llm_rerank is not None
    assert rec.manifest.llm_rerank.true_id == vocab[two[0]]
    # A decoder family whose reranker we do not serve is refused by name.
    other = module_tmp / "Llama-Reranker"
    shutil.copytree(model_dir, other)
    cfg = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps(cfg | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    (other / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.base.modules.transformer.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_LogitScore",
                    "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore",
                },
            ]
        )
    )
    with pytest.raises(ArtifactInvalid, match="model_type 'llama' is not served"):
        store.ingest_hf_dir(other, "y", dtype="f32")
    # A GGUF without the checkpoint's template (only the rendered default prompt) is refused.
    bare = rewrite_gguf(
        llama_gguf, module_tmp / "no-template.gguf", drop_kv=("tokenizer.chat_template",)
    )
    with pytest.raises(ArtifactInvalid, match="no tokenizer.chat_template"):
        store.ingest_gguf(bare, "z", prove=prove_gguf_tokenizer)


def test_over_http_with_the_official_clients(store, cross_encoder):
    import cohere
    import httpx

    from tests.test_serve_support import ServerProcess, server_config

    srv = ServerProcess(server_config(str(store.root), preload=["llmr"]))
    try:
        docs = DOCS[:4]
        ref = _reference(cross_encoder, QUERIES[2], docs)
        ref_instr = _reference(cross_encoder, QUERIES[2], docs, INSTRUCTION)
        sig = [1 / (1 + math.exp(-x)) for x in ref]
        sig_instr = [1 / (1 + math.exp(-x)) for x in ref_instr]
        v2 = cohere.ClientV2(api_key="unused", base_url=srv.url, timeout=120)
        got = v2.rerank(model="llmr", query=QUERIES[2], documents=docs)
        assert {r.index: r.relevance_score for r in got.results} == pytest.approx(
            dict(enumerate(sig)), abs=5e-3
        )
        got = v2.rerank(
            model="llmr",
            query=QUERIES[2],
            documents=docs,
            request_options={"additional_body_parameters": {"instruction": INSTRUCTION}},
        )
        assert {r.index: r.relevance_score for r in got.results} == pytest.approx(
            dict(enumerate(sig_instr)), abs=5e-3
        )
        v1 = cohere.Client(api_key="unused", base_url=srv.url, timeout=120)
        got1 = v1.rerank(model="llmr", query=QUERIES[2], documents=docs, top_n=2)
        assert [r.index for r in got1.results] == list(np.argsort(-ref, kind="stable")[:2])
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            tei = http.post(
                "/rerank",
                json={
                    "model": "llmr",
                    "query": QUERIES[2],
                    "texts": docs,
                    "raw_scores": True,
                    "instruction": INSTRUCTION,
                },
            )
            assert tei.status_code == 200, tei.text
            assert {r["index"]: r["score"] for r in tei.json()} == pytest.approx(
                dict(enumerate(ref_instr)), abs=2e-2
            )
            spec = http.get("/openapi.json").json()
            assert "instruction" in json.dumps(spec["components"]) or "instruction" in json.dumps(
                spec
            )
    finally:
        srv.stop()


async def test_certify_judges_the_llm_reranker_with_cross_encoder(store, module_tmp):
    import tempfile

    from certification.runner import RunOptions, certify
    from certification.store import CertificateStore

    certs = CertificateStore(module_tmp / "certificates")
    config = ModuleConfig(
        store_root=str(store.root),
        host=HostConfig(runtime_dir=tempfile.mkdtemp(prefix="syn-", dir="/tmp"), ping_interval_s=0),
    )
    async with Module(config) as mod:
        cert = await certify(mod, RunOptions(model="llmr", sample_stride=8, curve=False), certs)
    checks = {c.name: c for c in cert.checks}
    assert checks["quality.rerank_same_order"].status == "pass", checks["quality.rerank_same_order"]
    err = checks["quality.rerank_max_abs_error"]
    assert err.status == "pass" and err.value is not None and err.value <= 2e-2, err
    assert "instruction" in (err.detail or "")
    assert cert.status == "certified", cert.failing


def test_the_lane_computes_no_lm_head_and_decodes_the_shared_prefix_once(store, monkeypatch):
    """In process, one context: scoring 12 pairs decodes their common prefix (template,
    instruction, query) once and then only each pair's own tokens, with one output per pair;
    no graph node after the final norm runs (the full-vocabulary LM head is never computed),
    and the scores are those of each pair decoded whole, alone."""
    from host.chat_pairs import ChatPairs
    from workers.engine import NullProgress
    from workers.llama import last_states, last_token, native
    from workers.llama.engine import LlamaEngine

    rec = store.get("llmr")
    engine = LlamaEngine()
    engine.load(
        m.LOAD(
            req_id=0,
            artifact_path=str(rec.artifact_path),
            artifact_digest=rec.digest,
            format="gguf",
            runtime_config={"model_ref": "llmr", "encode_streams": 1, "n_threads": 1},
        ),
        NullProgress(),
    )
    spec, tok = rec.manifest.llm_rerank, rec.tokenizer_path
    assert spec is not None and tok is not None
    pairs = ChatPairs(spec, tok.read_text(encoding="utf-8"))
    ids = [np.asarray(pairs.ids(QUERIES[2], d, None), np.int32) for d in (DOCS + TEXTS[11:15])]
    decoded, outputs, after_norm = [], [], []
    decode = native.decode

    def watched(slot, batch):
        decoded.append(batch.n_tokens)
        outputs.append(int(slot.out[: batch.n_tokens].sum()))
        decode(slot, batch)

    spy = last_states.LastStates._eval

    def eval_spy(self, tensor, ask, user):
        if ask and self._rows:
            after_norm.append(last_states._lib.ggml_get_name(tensor))
        return spy(self, tensor, ask, user)

    monkeypatch.setattr(native, "decode", watched)
    monkeypatch.setattr(last_states.LastStates, "_eval", eval_spy)

    def score(seqs: list[np.ndarray]) -> np.ndarray:
        req = m.RERANK_SEQUENCES(
            req_id=0,
            model_ref="llmr",
            sequences=[m.RerankSequence(n_tokens=len(s), n_first=len(s)) for s in seqs],
        )
        return engine.rerank_sequences(req, np.concatenate(seqs), NullProgress())

    try:
        together = score(ids)
        p = last_token.shared_prefix(ids)
        assert p >= last_token.MIN_SHARED_PREFIX
        assert sum(decoded) == p + sum(len(s) - p for s in ids)
        assert outputs[0] == 0 and sum(outputs) == len(ids)
        assert after_norm == []
        decoded.clear()
        alone = np.array([score([s])[0] for s in ids])
        assert decoded == [len(s) for s in ids]  # a lone pair shares nothing
    finally:
        engine.close()
    assert np.abs(alone - together).max() <= 1e-5

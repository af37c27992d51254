"""Gemma 3 LLM rerankers (a Gemma3ForCausalLM that sentence-transformers 6 loads as a
`CrossEncoder` ending in `LogitScore("yes", "no")`) converted by our converter to llama.cpp's
causal `gemma3` and served through the same two-row head as Qwen3-Reranker, judged against
`CrossEncoder` raw scores on a tiny seeded model: test_hf_gemma3's tiny Gemma 3, causal, with
random RMSNorm weights, a sliding window shorter than the pairs on half the layers, a
SentencePiece vocabulary holding `yes` and `no`, and a Qwen3-Reranker-style template in
Gemma's turn format that starts with `<bos>`.

llama.cpp's own converter writes such a checkpoint as a plain gemma3 language model (no rank
pooling, no labels): our ingest of the directory is the way in."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from common.errors import ArtifactInvalid
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.hf_dir import convert_hf_dir
from ingest.store import ArtifactStore
from tests.test_hf_gemma3 import tiny_gemma3
from tests.test_llm_rerank import DOCS, INSTRUCTION, QUERIES

pytestmark = pytest.mark.model

MAX_SEQ = 256
TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(instruction='Given a web search query, retrieve relevant passages "
    "that answer the query', query='', document='') -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message.role == 'system' -%}{%- set ns.instruction = message.content -%}\n"
    "{%- elif message.role == 'query' -%}{%- set ns.query = message.content -%}\n"
    "{%- elif message.role == 'document' -%}{%- set ns.document = message.content -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "<start_of_turn>user\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".\n'
    "<Instruct>: {{ ns.instruction }}\n<Query>: {{ ns.query }}\n"
    "<Document>: {{ ns.document }}<end_of_turn>\n<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    import torch
    from sentence_transformers import CrossEncoder

    raw = tiny_gemma3(
        module_tmp / "gemma3-raw",
        causal=True,
        extra=["yes", "no", TEMPLATE] * 100,  # so the vocabulary holds "yes" and "no"
        max_len=MAX_SEQ,
        chat_template=TEMPLATE,
    )
    st = module_tmp / "gemma3-reranker"
    CrossEncoder(str(raw), device="cpu", activation_fn=torch.nn.Identity()).save(str(st))
    return st


@pytest.fixture(scope="module")
def store(module_tmp, model_dir) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    s.ingest_hf_dir(model_dir, "grr", dtype="f32")
    return s


def test_the_checkpoint_is_what_cross_encoder_scores(store, model_dir):
    """sentence-transformers saved it ending in LogitScore on the "yes"/"no" tokens, which
    ingest picked the same; the GGUF has no cls.output (llama.cpp's gemma3 would not load
    it): the worker reads the two rows of the tied LM head."""
    from formats.gguf_header import read_gguf_header

    modules = json.loads((model_dir / "modules.json").read_text())
    assert modules[-1]["type"].endswith("LogitScore")
    logit_score = json.loads((model_dir / modules[-1]["path"] / "config.json").read_text())
    spec = store.get("grr").manifest.llm_rerank
    assert spec is not None and (spec.true_token, spec.false_token) == ("yes", "no")
    assert (spec.true_id, spec.false_id) == (
        logit_score["true_token_id"],
        logit_score["false_token_id"],
    )
    hdr = read_gguf_header(store.get("grr").artifact_path)
    assert hdr.architecture == "gemma3"
    assert {t.name for t in hdr.tensors} & {"cls.output.weight", "output.weight"} == set()


async def test_scores_are_cross_encoders_raw_scores(store, model_dir, short_runtime_dir):
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(model_dir), device="cpu", activation_fn=torch.nn.Identity())
    config = ModuleConfig(
        store_root=str(store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    worst = 0.0
    async with Module(config) as mod:
        for q in QUERIES[:2]:
            for instr in (None, INSTRUCTION):
                kw = {} if instr is None else {"prompt": instr}
                ref = np.asarray(ce.predict([(q, d) for d in DOCS], **kw), np.float64)
                got = await mod.rerank(q, DOCS, model="grr", instruction=instr)
                raw = np.empty(len(DOCS))
                for i, s in got.results:
                    raw[i] = s
                assert [i for i, _ in got.results] == list(np.argsort(-ref, kind="stable"))
                assert np.ptp(ref) > 1.0, ref
                worst = max(worst, float(np.abs(raw - ref).max()))
                assert not any(got.truncated)
    print(f"Gemma 3: max |raw - CrossEncoder raw| = {worst:.2e}")
    assert worst <= 2e-2


def test_what_llama_cpp_s_gemma3_would_compute_otherwise_is_refused(model_dir, module_tmp):
    config = json.loads((model_dir / "config.json").read_text())
    bad = module_tmp / "gemma3-bad"
    shutil.copytree(model_dir, bad)
    for change, reason in (
        ({"final_logit_softcapping": 30.0}, "not the difference of two LM-head rows"),
        ({"use_bidirectional_attention": True}, "gemma3 graph is causal"),
        # At 62 layers llama.cpp assumes Gemma 3 27B's query scale, 1/sqrt(hidden / heads).
        ({"num_hidden_layers": 62, "num_attention_heads": 2}, "62-layer model's queries"),
    ):
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ArtifactInvalid, match=reason):
            convert_hf_dir(bad, module_tmp / "bad.gguf", "f32")

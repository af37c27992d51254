"""Decoder sequence classifiers (`Qwen3ForSequenceClassification`: transformers'
`GenericForSequenceClassification`, a bias-free `score` head read at the rightmost token that
is not the config's pad id) on the llama.cpp lane, from a Hugging Face directory through
`models ingest`, judged on tiny seeded models built here (the LLM reranker tests' trained BPE
vocabulary and Qwen3-Reranker-style chat template):

- one label, a reranker: against sentence-transformers 6 `CrossEncoder` raw scores, which
  renders pairs through the tokenizer's chat template when it has one, and tokenizes them as
  a plain pair when it has none;
- three labels: against transformers' text-classification pipeline (texts and pairs);
- the scored position: against `AutoModelForSequenceClassification` on ids ending in pad ids.

llama.cpp's own converter is the other way in for Qwen3 rerankers, but the pinned one has no
entry for this architecture (it stops with "not supported"): a test holds that, so the day
it gains one the test says so and its GGUF can be judged here too.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from certification.tokenizer_proof import prove_gguf_tokenizer
from common.errors import ArtifactInvalid, InvalidRequest
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.store import ArtifactStore
from tests.llama_converter import converter_dir
from tests.test_hf_qwen3 import tiny_qwen3_config
from tests.test_llm_rerank import DOCS, INSTRUCTION, QUERIES, TEXTS, _tokenizer

pytestmark = [pytest.mark.model, pytest.mark.timeout(1200)]

SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}
PAIRS = [(QUERIES[0], DOCS[0]), (QUERIES[1], DOCS[3])]
RAW_BAR = 2e-2  # the certification bar on raw scores (the LLM reranker's)
PROB_TOL = 2e-2  # test_classify's bar on probabilities
TEXTS_IDS = [17, 40, 91, 12, 300, 5]  # any ids of the vocabulary


def tiny_qwen3_classifier(
    dst: Path, tokenizer_dir: Path, n_vocab: int, labels: dict[int, str]
) -> Path:
    """A seeded 2-layer Qwen3ForSequenceClassification over `tokenizer_dir`'s tokenizer, its
    pad id the tokenizer's (<|endoftext|>), as converted Qwen3 rerankers set it."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForSequenceClassification

    shutil.copytree(tokenizer_dir, dst)
    pad = AutoTokenizer.from_pretrained(dst).pad_token_id
    config = tiny_qwen3_config(n_vocab)
    config.id2label = dict(labels)
    config.label2id = {v: k for k, v in labels.items()}
    config.pad_token_id = pad
    torch.manual_seed(len(labels))
    Qwen3ForSequenceClassification(config).eval().save_pretrained(dst)
    return dst


def _without_template(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    tok = module_tmp / "tokenizer"
    n_vocab = _tokenizer(tok)
    rr = tiny_qwen3_classifier(module_tmp / "qwen3-seqcls-rr", tok, n_vocab, {0: "LABEL_0"})
    return {
        "rr": rr,
        "rr-plain": _without_template(rr, module_tmp / "qwen3-seqcls-plain"),
        "cls3": tiny_qwen3_classifier(module_tmp / "qwen3-seqcls-3", tok, n_vocab, SENTIMENT),
    }


@pytest.fixture(scope="module")
def store(module_tmp, dirs) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "models")
    for name, path in dirs.items():
        s.ingest_hf_dir(path, name, dtype="f32")
    return s


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


def test_llama_cpp_s_converter_has_no_entry_for_it():
    """Its main() maps config.json's architecture through conversion.TEXT_MODEL_MAP and exits
    ("Model ... is not supported") on a name the map lacks; read without running it (the
    script imports torch)."""
    source = (converter_dir() / "conversion" / "__init__.py").read_text()
    tree = ast.parse(source)
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "TEXT_MODEL_MAP"
    )
    names = set(ast.literal_eval(table))
    assert {"Qwen3ForCausalLM", "Qwen3Model"} <= names  # the table read is the right one
    assert "Qwen3ForSequenceClassification" not in names
    main = (converter_dir() / "convert_hf_to_gguf.py").read_text()
    assert 'logger.error(f"Model {model_architecture} is not supported")' in main


def test_ingest_records_the_head(store):
    from formats.gguf_header import SEQ_CLS_PAD_KEY, read_gguf_header

    rr, plain, cls3 = (store.get(n).manifest for n in ("rr", "rr-plain", "cls3"))
    assert (rr.kind, rr.pooling, rr.n_labels) == ("rerank", "last", 1)
    # One label with a chat template: its pairs are rendered through it, no scored tokens.
    assert rr.llm_rerank is not None and rr.llm_rerank.true_id is None
    assert plain.llm_rerank is None and cls3.llm_rerank is None
    assert (cls3.labels, cls3.n_labels) == (list(SENTIMENT.values()), 3)
    hdr = read_gguf_header(store.get("cls3").artifact_path)
    pad = json.loads((store.get("cls3").dir / "tokenizer.json").read_text())["added_tokens"]
    assert hdr.kv[SEQ_CLS_PAD_KEY] == next(t["id"] for t in pad if t["content"] == "<|endoftext|>")
    assert hdr.arch_get("pooling_type") == 4  # rank, as llama.cpp's Qwen3 rerankers
    # Its GGUF alone lacks the problem type and pair template: the directory is the way in.
    with pytest.raises(InvalidRequest, match="ingest its Hugging Face directory"):
        store.ingest_gguf(store.get("cls3").artifact_path, "again", prove=prove_gguf_tokenizer)


def test_a_template_that_drops_the_pair_is_refused_as_cross_encoder_refuses_it(dirs, module_tmp):
    """A chat model's template (system/user/assistant only) renders a pair to a prompt
    without it: sentence-transformers will not score it, and ingest refuses it, saying so."""
    from sentence_transformers import CrossEncoder

    chat_only = _without_template(dirs["rr"], module_tmp / "qwen3-seqcls-chat-only")
    (chat_only / "chat_template.jinja").write_text(
        "{%- for m in messages %}{%- if m.role in ('system', 'user', 'assistant') %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    )
    with pytest.raises(ValueError, match="cannot carry a 'query'/'document' pair"):
        CrossEncoder(str(chat_only), device="cpu").predict([("q", "d")])
    store = ArtifactStore(module_tmp / "refused")
    with pytest.raises(ArtifactInvalid, match="'query' and 'document' content does not reach"):
        store.ingest_hf_dir(chat_only, "chat-only", dtype="f32")


async def test_one_label_reranks_as_cross_encoder(store, dirs, short_runtime_dir):
    """The chat-template model with and without an instruction, and the plain-pair model."""
    import torch
    from sentence_transformers import CrossEncoder

    worst = 0.0
    async with _module(store, short_runtime_dir) as mod:
        for name, instructions in (("rr", (None, INSTRUCTION)), ("rr-plain", (None,))):
            ce = CrossEncoder(str(dirs[name]), device="cpu", activation_fn=torch.nn.Identity())
            for q in QUERIES[:2]:
                for instr in instructions:
                    kw = {} if instr is None else {"prompt": instr}
                    ref = np.asarray(ce.predict([(q, d) for d in DOCS], **kw), np.float64)
                    got = await mod.rerank(q, DOCS, model=name, instruction=instr)
                    raw = _raw(got, len(DOCS))
                    assert [i for i, _ in got.results] == list(np.argsort(-ref, kind="stable"))
                    worst = max(worst, float(np.abs(raw - ref).max()))
                    assert np.ptp(ref) > 1.0, ref  # the scores differ: the test can see a slip
    print(f"max |raw - CrossEncoder raw| = {worst:.2e}")
    assert worst <= RAW_BAR


async def test_three_labels_classify_as_the_pipeline(store, dirs, short_runtime_dir):
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(dirs["cls3"]), device="cpu")
    inputs = [*TEXTS[:4], *({"text": a, "text_pair": b} for a, b in PAIRS)]
    labels = list(SENTIMENT.values())
    want = {}
    for function in ("default", "none"):
        kw = {} if function == "default" else {"function_to_apply": "none"}
        rows = [{d["label"]: d["score"] for d in clf(x, top_k=None, **kw)} for x in inputs]
        want[function] = np.array([[r[label] for label in labels] for r in rows])
    async with _module(store, short_runtime_dir) as mod:
        got = await mod.classify([*TEXTS[:4], *PAIRS], "cls3")
    assert got.labels == labels and got.activation == "softmax"
    prob = np.abs(got.scores() - want["default"]).max()
    raw = np.abs(got.scores(raw_scores=True) - want["none"]).max()
    print(f"cls3: max |prob diff| {prob:.2e}, max |logit diff| {raw:.2e}")
    assert prob <= PROB_TOL and raw <= 1e-2
    assert np.ptp(want["none"]) > 1.0
    assert (got.scores().argmax(axis=1) == want["default"].argmax(axis=1)).all()


async def test_the_score_is_read_at_the_last_non_pad_token(store, dirs, short_runtime_dir):
    """transformers pools the rightmost token that is not the pad id, so ids ending in pad
    ids score as without them; reading the very last token would not."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(dirs["cls3"])).eval()
    pad = model.config.pad_token_id
    tok = json.loads((dirs["cls3"] / "tokenizer.json").read_text())["model"]["vocab"]
    ids = [tok[t] for t in ("yes", "no", "yes")] + [pad, pad]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
        model.config.pad_token_id = None  # now the last token: the pad itself
        last = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(ref - last).max() > 1e-1  # the rule matters for these ids
    async with _module(store, short_runtime_dir) as mod:
        got = await mod.classify_token_ids([np.asarray(ids, np.int32)], "cls3")
    assert np.abs(got.logits[0] - ref).max() <= 1e-2, (got.logits[0], ref)


async def test_llama_cpp_s_own_rank_pooling_would_softmax_the_head(store, short_runtime_dir):
    """Why the worker applies the rows itself: llama.cpp loads the GGUF as a Qwen3 reranker
    and its RANK pooling answers softmax(rows . h) at the last token, probabilities whatever
    the problem type (a one-label head: always 1.0), where the lane answers the raw logits."""
    import llama_cpp

    ids = np.asarray(TEXTS_IDS, np.int32)
    async with _module(store, short_runtime_dir) as mod:
        lane = (await mod.classify_token_ids([ids], "cls3")).logits[0].astype(np.float64)
        one = (await mod.classify_token_ids([ids], "rr")).logits[0]
    for name, n in (("cls3", 3), ("rr", 1)):
        llm = llama_cpp.Llama(
            str(store.get(name).artifact_path),
            n_ctx=256,
            verbose=False,
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
        )
        try:
            llm.eval(list(ids))
            out = llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)
            got = np.ctypeslib.as_array(out, shape=(n,)).astype(np.float64)
        finally:
            llm.close()
        if name == "cls3":
            softmax = np.exp(lane - lane.max()) / np.exp(lane - lane.max()).sum()
            assert np.abs(got - softmax).max() <= 1e-3, (got, softmax)
        else:
            assert got.tolist() == [1.0] and abs(float(one[0])) > 0.1

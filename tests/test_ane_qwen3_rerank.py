"""Qwen3 causal LM rerankers on the Core ML lane (Qwen3-Reranker: the raw score is
logit[yes] - logit[no] at the last real token), judged through the reference executor (fp16
emulated) against sentence-transformers' CrossEncoder (LogitScore, Identity activation) and
transformers' own forward, on a tiny seeded Qwen3ForCausalLM whose trained BPE vocabulary
holds `yes` and `no`. The sequences scored are the ones CrossEncoder composes (its chat
template, its truncation): rendering pairs is the host's job and not under test here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from certification.corpus import corpus, documents, queries
from certification.thresholds import thresholds_for
from formats.owned.manifest import Manifest, build_body, ingest_owned
from formats.owned.model import Head, ManifestError, UnsupportedModel
from formats.owned.rank_head import SCORE_WEIGHT
from tests.ane_support import load_reference_engine
from tests.test_hf_qwen3 import EOT, QWEN2_SPLIT, tiny_qwen3_config
from workers.ane import placement, program_ir
from workers.ane.build_options import BuildOptions
from workers.ane.compiler import cache_key
from workers.ane.engine import AneEngine
from workers.ane.identity import kernel_revision
from workers.ane.packing import plan
from workers.ane.shapes import Shape
from workers.engine import EngineError, NullProgress
from workers.protocol import messages as m

pytestmark = pytest.mark.model

MAX_SEQ = 64
HIDDEN = 64
UNPACKED = {"rows": 4, "seq_len": MAX_SEQ}
PACKED = {"rows": 2, "seq_len": 128, "packed": True, "max_segments": 8}
# Pairs of every length: long ones cut at MAX_SEQ, short ones packed several to a row.
PAIRS = [(q, d) for i, q in enumerate(queries()[:4]) for d in documents()[i::9][:4]] + [
    ("cats?", "A cat sleeps."),
    ("rain", "It rains."),
    ("yes?", "no."),
    ("a", "b"),
    ("Tell me about dogs", "Dogs bark."),
    ("trains", "The train is late."),
    ("library hours", "The library closes early."),
    ("", "Empty query."),
]
# A Qwen-style chat template: CrossEncoder renders each pair through it.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(dst: Path) -> None:
    """Qwen2's split and byte-level BPE trained on the corpus plus the answers, so `yes`
    and `no` are single tokens as in Qwen3's vocabulary."""
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
    tok.train_from_iterator(
        list(corpus()) * 2 + ["yes", "no"] * 200,
        trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=[EOT, "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token=EOT, model_max_length=MAX_SEQ
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(dst)


def _model(dst: Path, tied: bool) -> None:
    """A seeded 2-layer Qwen3ForCausalLM (grouped heads, head_dim != hidden / heads, wide
    random weights, so a wrong token, row or position moves the score far past the bar)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen3_config(len(AutoTokenizer.from_pretrained(dst)), tied=tied)
    Qwen3ForCausalLM(config).eval().save_pretrained(dst)


@pytest.fixture(scope="module")
def dirs(module_tmp) -> dict[str, Path]:
    from sentence_transformers import CrossEncoder

    raw = module_tmp / "raw"
    _tokenizer(raw)
    _model(raw, tied=True)
    ce = module_tmp / "ce"  # sentence-transformers 6's own save: Transformer + LogitScore
    CrossEncoder(str(raw), device="cpu").save(str(ce))
    named = module_tmp / "named"  # a plain HF dir that says what it is, as Qwen3-Reranker's
    shutil.copytree(raw, named)
    (named / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-0.6B\n")
    untied = module_tmp / "untied"  # its own lm_head (Qwen3-Reranker-8B's layout)
    _tokenizer(untied)
    _model(untied, tied=False)
    return {"raw": raw, "ce": ce, "named": named, "untied": untied}


@pytest.fixture(scope="module")
def manifests(dirs, module_tmp) -> dict[str, Manifest]:
    return {
        "ce": ingest_owned(dirs["ce"], module_tmp / "owned-ce"),
        "untied": ingest_owned(
            dirs["untied"], module_tmp / "owned-untied", true_token="yes", false_token="no"
        ),
    }


def _yes_no(model_dir: Path) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.convert_tokens_to_ids(t) for t in ("yes", "no")]
    assert all(isinstance(i, int) for i in ids)
    return ids[0], ids[1]  # type: ignore[return-value]


def _transformers_scores(model_dir: Path, ids: list[np.ndarray]) -> np.ndarray:
    """logit[yes] - logit[no] at the last token, one unpadded sequence at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    yes, no = _yes_no(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for x in ids:
            logits = lm(torch.tensor(x[None].astype(np.int64))).logits[0, -1]
            out.append(float(logits[yes] - logits[no]))
    return np.asarray(out, np.float32)


@pytest.fixture(scope="module")
def reference(dirs) -> dict:
    import torch
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(dirs["ce"]), device="cpu")
    feats = ce.preprocess(PAIRS)  # left-padded: the real tokens are where the mask is 1
    ids = [
        row[mask.bool()].numpy().astype(np.int32)
        for row, mask in zip(feats["input_ids"], feats["attention_mask"], strict=True)
    ]
    return {
        "ids": ids,
        "ce": ce.predict(PAIRS, activation_fn=torch.nn.Identity()),
        "transformers": _transformers_scores(dirs["ce"], ids),
    }


def _engine(manifest: Manifest, shape: dict, cache: Path) -> AneEngine:
    return load_reference_engine(
        manifest, {"model_ref": "rr", "shapes": [shape], "cache_root": str(cache)}
    )


@pytest.fixture(scope="module")
def engines(manifests, module_tmp):
    out = {
        name: _engine(manifests["ce"], shape, module_tmp / "cache")
        for name, shape in (("unpacked", UNPACKED), ("packed", PACKED))
    }
    yield out
    for engine in out.values():
        engine.close()


def _score(engine: AneEngine, ids: list[np.ndarray]) -> np.ndarray:
    # Composed sequences, as the host sends a rendered pair: n_first is unread by a decoder.
    req = m.RERANK_SEQUENCES(
        req_id=2,
        model_ref="rr",
        sequences=[m.RerankSequence(n_tokens=len(x), n_first=len(x)) for x in ids],
    )
    return engine.rerank_sequences(req, np.concatenate(ids), NullProgress())


def _bar(manifest: Manifest) -> float:
    """The Core ML lane's fp16 rerank bar in this score's units. The gate is set for logits
    of order 1; fp16 is a relative format, and this score is the dot product of its row with
    a normed state of RMS 1, so its natural spread is the norm of the row times the final
    norm's gains: the fp16 error the decoder leaves in that state (as small as the
    embedder's, cosine ~0.999996 here) reaches the score at that scale."""
    w = manifest.load_weights()
    scale = float(np.linalg.norm(w[SCORE_WEIGHT][0] * w["norm.weight"]))
    return thresholds_for("ane", "fp16").rerank_max_abs * max(1.0, scale)


# ---- the manifest ---------------------------------------------------------------------------


def test_the_manifest_keeps_one_score_row_from_the_two_answer_rows(dirs, manifests):
    from safetensors.numpy import load_file

    for name, head_file, head_name in (
        ("ce", "model.safetensors", "model.embed_tokens.weight"),  # tied: the embedding rows
        ("untied", "model.safetensors", "lm_head.weight"),
    ):
        man = manifests[name]
        yes, no = _yes_no(dirs[name])
        assert man.head == Head(
            type="rank_last",
            pooling="last",
            normalize=False,
            num_labels=1,
            true_token_id=yes,
            false_token_id=no,
        )
        w = man.load_weights()
        table = load_file(str(dirs[name] / head_file))[head_name]
        assert w[SCORE_WEIGHT].shape == (1, HIDDEN)
        np.testing.assert_array_equal(w[SCORE_WEIGHT][0], table[yes] - table[no])
        # Never a vocabulary-wide head: the LM head is not in the artifact.
        assert not any(n.startswith("lm_head") for n in w)
    # The untied model's rows are its lm_head's, not its embedding's.
    w = manifests["untied"].load_weights()
    yes, no = _yes_no(dirs["untied"])
    table = w["embed_tokens.weight"]
    assert not np.allclose(w[SCORE_WEIGHT][0], table[yes] - table[no])


def test_where_the_answer_tokens_come_from_and_what_is_refused(dirs, manifests, module_tmp):
    yes, no = _yes_no(dirs["raw"])
    # A README that says Qwen3-Reranker: the tokenizer's `yes` and `no`.
    named, _ = build_body(dirs["named"])
    assert (named.head.type, named.head.true_token_id, named.head.false_token_id) == (
        "rank_last",
        yes,
        no,
    )
    # Tokens the user names, as strings or ids; another token is another head and digest.
    by_name, _ = build_body(dirs["raw"], true_token="yes", false_token="no")
    by_id, _ = build_body(dirs["raw"], true_token=yes, false_token=no)
    other, _ = build_body(dirs["raw"], true_token="yes", false_token=EOT)
    assert by_name == by_id and by_name.head == named.head
    assert other.head.false_token_id != no
    assert other.tensors[SCORE_WEIGHT].sha256 != by_name.tensors[SCORE_WEIGHT].sha256
    # Without anything that says reranker, a causal LM dir is an embedder (refused here for
    # having no last-token Pooling), and an embedder's head serialises as it always did, so
    # every embedder artifact's digest is unchanged.
    with pytest.raises(UnsupportedModel, match="last token"):
        build_body(dirs["raw"])
    embed = Head(type="embed_last", pooling="last", normalize=True, num_labels=0)
    assert set(msgspec.to_builtins(embed)) == {"type", "pooling", "normalize", "num_labels"}
    for kwargs, error, reason in (
        ({"true_token": "maybe", "false_token": "no"}, UnsupportedModel, "no single token 'maybe'"),
        ({"true_token": "yes"}, ManifestError, "both"),
        ({"true_token": "yes", "false_token": "yes"}, UnsupportedModel, "same token"),
        ({"true_token": 10**6, "false_token": "no"}, ManifestError, "outside the vocabulary"),
    ):
        with pytest.raises(error, match=reason):
            build_body(dirs["raw"], **kwargs)
    bad = module_tmp / "bad"
    shutil.copytree(dirs["ce"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3Model"]}))
    with pytest.raises(UnsupportedModel, match="Qwen3ForCausalLM"):
        build_body(bad)
    (bad / "config.json").write_text(json.dumps(config))
    modules = json.loads((bad / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.Dense"}
    (bad / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(UnsupportedModel, match="Transformer \\+ LogitScore only"):
        build_body(bad)


def test_the_gguf_llama_cpps_converter_writes_builds_the_same_artifact(dirs, manifests, module_tmp):
    """llama.cpp's converter writes a Qwen3 reranker as the qwen3 body (tied: token_embd),
    rank pooling, labels [yes, no] and `cls.output.weight` holding the LM head's yes and no
    rows (conversion/qwen.py); made here from our converter's f32 body GGUF."""
    import gguf
    from safetensors.numpy import load_file

    from ingest.hf_dir import convert_hf_dir
    from tests.gguf_edit import rewrite_gguf

    body = module_tmp / "body.gguf"
    convert_hf_dir(dirs["raw"], body, "f32", pooling="last")
    yes, no = _yes_no(dirs["raw"])
    table = load_file(str(dirs["raw"] / "model.safetensors"))["model.embed_tokens.weight"]
    kind = gguf.GGUFValueType

    def reranker(labels: list[str]) -> Path:
        return rewrite_gguf(
            body,
            module_tmp / f"rank-{'-'.join(labels)}.gguf",
            set_kv={
                "qwen3.pooling_type": (int(gguf.PoolingType.RANK), kind.UINT32),
                "qwen3.classifier.output_labels": (labels, kind.ARRAY, kind.STRING),
            },
            add_tensors={"cls.output.weight": np.stack([table[yes], table[no]])},
        )

    tok = dirs["raw"] / "tokenizer.json"
    man = ingest_owned(reranker(["yes", "no"]), module_tmp / "owned-gguf", tokenizer=tok)
    from_dir = manifests["ce"]
    # The ids are gone from the file (the rows stay): the head names none.
    assert man.head == msgspec.structs.replace(
        from_dir.head, true_token_id=None, false_token_id=None
    )
    a, b = man.load_weights(), from_dir.load_weights()
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    same = ("architecture", "num_layers", "num_kv_heads", "head_dim", "rope_theta", "pad_token_id")
    assert all(getattr(man.config, f) == getattr(from_dir.config, f) for f in same)
    # Rows in another order would score with the answers swapped.
    with pytest.raises(UnsupportedModel, match="yes, no"):
        ingest_owned(reranker(["no", "yes"]), module_tmp / "owned-gguf-swapped", tokenizer=tok)


def test_a_reranker_compiles_under_its_own_revision_and_keys(manifests):
    man = manifests["ce"]
    revision = kernel_revision("qwen3", "rank_last")
    # It extends the Qwen3 revision: the embedders' compiled shapes and certificates keep
    # theirs, and never match a reranker's.
    assert revision.startswith(kernel_revision("qwen3")) and revision != kernel_revision("qwen3")
    assert kernel_revision("qwen3", "embed_last") == kernel_revision("qwen3")
    key = cache_key(man, Shape(4, MAX_SEQ), BuildOptions())
    assert (key["kernel_revision"], key["head"]) == (revision, "rank_last")
    assert AneEngine(man.dir).hello_extras()["kernel_revision"] == revision


# ---- fidelity -------------------------------------------------------------------------------


def test_scores_match_crossencoder_and_transformers_packed_and_unpacked(
    engines, manifests, reference
):
    ids, want = reference["ids"], reference["ce"]
    # The two references agree: CrossEncoder's LogitScore is logit[yes] - logit[no] at the
    # last real token of exactly these ids.
    np.testing.assert_allclose(want, reference["transformers"], atol=1e-4)
    lengths = [len(x) for x in ids]
    assert max(lengths) == MAX_SEQ and min(lengths) < 30
    # The packed engine really packs: several segments per row.
    rows = [r for c in plan(lengths, [Shape(**PACKED)]) for r in c.rows]
    assert max(len(r) for r in rows) >= 3
    bar = _bar(manifests["ce"])
    # The scores spread far beyond the bar: another token pooled, the rows swapped or a
    # norm left out would be off by about this much.
    assert want.std() > 20 * bar
    got = {layout: _score(engine, ids) for layout, engine in engines.items()}
    errors = {layout: float(np.abs(s - want).max()) for layout, s in got.items()}
    print(
        f"\nqwen3 reranker over {len(ids)} pairs: max |raw diff| "
        + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
        + f" (bar {bar:.2e}, score std {want.std():.2f}, max |score| {np.abs(want).max():.2f})"
    )
    assert max(errors.values()) <= bar, errors
    # Packed rows score as unpacked ones within a few fp16 roundings of the score's scale.
    ulp = 2.0**-10 * np.abs(got["unpacked"]).max()
    assert np.all(np.abs(got["packed"] - got["unpacked"]) <= 4 * ulp)


def test_an_untied_reranker_scores_with_its_own_lm_head(dirs, manifests, reference, module_tmp):
    man = manifests["untied"]
    ids = reference["ids"][:8]
    want = _transformers_scores(dirs["untied"], ids)
    engine = _engine(man, UNPACKED, module_tmp / "cache")
    try:
        got = _score(engine, ids)
    finally:
        engine.close()
    assert np.abs(got - want).max() <= _bar(man), np.abs(got - want).max()


def test_the_certification_reference_scores_composed_ids_as_crossencoder(dirs, reference):
    """The fp32 judge `synapse certify` uses takes composed ids: a causal LM's are padded on
    the left, where LogitScore reads the last position."""
    from certification.oracle import ST, Oracle

    oracle = Oracle(dirs["ce"], None, reference=ST)
    assert oracle.is_causal_reranker and not oracle.is_cross_encoder
    ids = reference["ids"]
    got = oracle.scores(ids, [np.zeros(len(x), np.int32) for x in ids])
    np.testing.assert_allclose(got, reference["ce"], atol=1e-4)


def test_the_worker_refuses_what_a_reranker_does_not_do(engines, reference):
    engine = engines["unpacked"]
    ids = reference["ids"][:2]
    with pytest.raises(EngineError, match="not an embedder"):
        engine.embed(
            m.EMBED_BATCH(
                req_id=3,
                model_ref="rr",
                pooling="last",
                normalize=True,
                items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
            ),
            np.concatenate(ids),
            NullProgress(),
        )
    bad = m.RERANK_SEQUENCES(
        req_id=4,
        model_ref="rr",
        sequences=[m.RerankSequence(n_tokens=len(ids[0]), n_first=len(ids[0]) + 1)],
    )
    with pytest.raises(EngineError, match="n_first"):
        engine.rerank_sequences(bad, ids[0], NullProgress())


# ---- placement ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
def test_the_score_head_is_ane_eligible_and_the_estimate_holds(engines, manifests, layout):
    engine = engines[layout]
    (compiled,) = engine._model.shapes.values()
    ops = [
        op
        for op in program_ir.walk(compiled.runner.program.function.operations)
        if op.op_type != "const"
    ]
    convs = [i for i, op in enumerate(ops) if op.op_type == "conv"]
    # q k v o gate up down per layer, and the one score row: no vocabulary-wide projection.
    assert len(convs) == 7 * manifests["ce"].config.num_layers + 1
    head = ops[convs[-2] + 1 : convs[-1] + 1]  # the pick, the final norm and the score conv
    assert [op.op_type for op in head if not placement.ane_eligible(op)] == []
    share, source = engine.placement()
    assert source == "estimate" and share >= 0.99, share

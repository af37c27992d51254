"""The multi-vector heads against their references, on transformers' own final hidden states.

Two tiny seeded checkpoints, built once for the module:

- a sentence-transformers 6 `MultiVectorEncoder` (ColBERT): a random BERT with MiniLM's
  WordPiece vocabulary, query/document prefixes ([unused0] / [unused1], registered as special
  tokens), fixed query expansion, a document length cap, the punctuation skiplist and two
  `Dense` layers (bias + tanh, then a bare projection) before token-level `Normalize`; also
  rewritten as a PyLate <= 3 save (prefixes and knobs at the top level, an unregistered marker)
  and with expansion tokens not attended;
- a bge-m3 in FlagEmbedding's layout: a random XLM-RoBERTa with `colbert_linear.pt` written by
  `torch.save`, scored with FlagEmbedding's formulas restated here (the package is not
  installed): `colbert_linear(h[:, 1:]) * mask[:, 1:]`, `F.normalize`, the first
  `sum(mask) - 1` rows, `colbert_score = sum(max) / len(q)`.

Our head (ingested, loaded, `prepare_ids` then `apply`) reads transformers' final states for
exactly the ids our `prepare_ids` gives, which must equal the ids the reference fed its
transformer; every vector is compared, and MaxSim against the reference's similarity.
"""

from __future__ import annotations

import json
import shutil
import string
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from common.errors import InvalidRequest
from formats.digest import sha256_file
from formats.multivector_head import MultiVectorHeadInvalid, read_head
from formats.torch_pt import TorchPtInvalid, read_torch_pt
from ingest.model_packages import minilm_dir
from ingest.multivector_heads import (
    MultiVectorCheckpointInvalid,
    UnsupportedMultiVectorHead,
    detect,
    ingest_multivector_head,
)
from workers.engine import EngineError
from workers.heads.multivector import load, maxsim, mean_maxsim

pytestmark = pytest.mark.model

HIDDEN, DIM = 64, 24
Q_LEN, DOC_LEN = 16, 24
QUERIES = [
    "what is a cat?",
    "Where do the seven rivers of Zürich meet, and which bridges cross them today near the lake?",
    "x",
]
DOCUMENTS = [
    "A cat, as it happens, is an animal.",
    "Bridges: (many) cross the Limmat; the rivers - Sihl and Limmat - meet north of the station, "
    "well past any text this short document cap would keep!",
    "Paris.",
]
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _same_vectors(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert _cos(ours, ref).min() >= 0.9999
    assert np.abs(ours - ref).max() < 1e-5


# ---- the ColBERT checkpoint ----------------------------------------------------------------


def _copy_tokenizer(dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (minilm_dir() / name).is_file():
            shutil.copyfile(minilm_dir() / name, dst / name)


@pytest.fixture(scope="module")
def colbert(module_tmp) -> Path:
    return tiny_colbert(module_tmp)


def tiny_colbert(module_tmp: Path) -> Path:
    """The tiny seeded ColBERT `MultiVectorEncoder`, saved under `module_tmp / "colbert"`
    (its raw BERT beside it, in `module_tmp / "bert"`)."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import AutoTokenizer, BertConfig, BertModel

    raw = module_tmp / "bert"
    _copy_tokenizer(raw)
    tok = AutoTokenizer.from_pretrained(str(raw))
    tok.add_special_tokens({"additional_special_tokens": ["[unused0]", "[unused1]"]})
    tok.save_pretrained(str(raw))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    BertModel(config).eval().save_pretrained(raw)
    body = Transformer(
        str(raw),
        query_expansion={"strategy": "fixed", "attend": True, "length": Q_LEN},
        document_length=DOC_LEN,
    )
    dense = [
        Dense(
            HIDDEN,
            32,
            bias=True,
            activation_function=torch.nn.Tanh(),
            module_input_name="token_embeddings",
        ),
        Dense(
            32,
            DIM,
            bias=False,
            activation_function=torch.nn.Identity(),
            module_input_name="token_embeddings",
        ),
    ]
    model = MultiVectorEncoder(
        modules=[
            body,
            *dense,
            MultiVectorMask(skiplist_words=list(string.punctuation)),
            Normalize(module_input_name="token_embeddings"),
        ],
        prompts={"query": "[unused0] ", "document": "[unused1] "},
        device="cpu",
    )
    out = module_tmp / "colbert"
    model.save(str(out))
    return out


@pytest.fixture(scope="module")
def bert(colbert):
    from transformers import BertModel

    return BertModel.from_pretrained(str(colbert)).eval()


def _states(encoder, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """transformers' final hidden states of one sequence (T, H)."""
    import torch

    with torch.inference_mode():
        t = torch.as_tensor(ids, dtype=torch.long)[None]
        m = torch.ones_like(t) if mask is None else torch.as_tensor(mask)[None]
        return encoder(input_ids=t, attention_mask=m).last_hidden_state[0].numpy()


def _bare_ids(model_dir: Path, text: str) -> list[int]:
    """What the host's tokenizer (the `tokenizers` library) gives for the bare text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok.encode(text).ids


def _check_against_reference(model_dir: Path, out_dir: Path, encoder, *, owned: bool = False):
    """Ingest, load, and compare each side's vectors and the MaxSim matrix with the reference."""
    from sentence_transformers import MultiVectorEncoder

    info = ingest_multivector_head(model_dir, out_dir)
    assert info is not None and info.kind == "colbert" and info.dims == DIM
    assert info.digest == sha256_file(out_dir / info.file)
    head = load(out_dir / info.file)
    ref = MultiVectorEncoder(str(model_dir), device="cpu")
    ours: dict[str, list[np.ndarray]] = {}
    refs: dict[str, list[np.ndarray]] = {}
    for side, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        refs[side] = ref.encode(
            texts, prompt=ref.prompts.get(side), task=side, convert_to_numpy=True
        )
        ours[side] = []
        for text, want in zip(texts, refs[side], strict=True):
            features = ref.preprocess([text], prompt=ref.prompts.get(side), task=side)
            ids = head.prepare_ids(_bare_ids(model_dir, text), side)
            assert ids.tolist() == features["input_ids"][0].tolist()
            mask = features["attention_mask"][0].numpy() if owned else None
            got = head.apply(_states(encoder, ids, mask), ids, side, owned_mask=owned)
            _same_vectors(got, want)
            ours[side].append(got)
    scores = ref.similarity(refs["query"], refs["document"]).numpy()
    mine = np.array([[maxsim(q, d) for d in ours["document"]] for q in ours["query"]])
    assert np.abs(mine - scores).max() < 1e-5
    from sentence_transformers.util.similarity import mean_maxsim as st_mean_maxsim

    means = st_mean_maxsim(refs["query"], refs["document"]).numpy()
    mine_mean = np.array([[mean_maxsim(q, d) for d in ours["document"]] for q in ours["query"]])
    assert np.abs(mine_mean - means).max() < 1e-6
    return head, refs


def test_colbert_head_matches_multivectorencoder(colbert, bert, module_tmp):
    head, refs = _check_against_reference(colbert, module_tmp / "out-native", bert)
    spec = head.spec
    # What the reference returns per token: [CLS], the prefix, the text, [SEP] and the expansion
    # tokens for a query (exactly Q_LEN); documents lose their punctuation and stop at DOC_LEN.
    assert [len(v) for v in refs["query"]] == [Q_LEN] * len(QUERIES)
    assert spec.query_prefix_ids == [1] and spec.document_prefix_ids == [2]
    assert spec.expansion is not None and spec.expansion.attend and spec.expansion.token_id == 103
    assert not head.needs_owned_mask("query") and not head.needs_owned_mask("document")
    assert spec.skiplist_sides == ["document"] and 1012 in spec.skiplist_ids  # "."
    assert len(head.prepare_ids(_bare_ids(colbert, DOCUMENTS[1]), "document")) == DOC_LEN
    # A caller that tokenized prompt + text itself gets the same ids.
    prompted = _bare_ids(colbert, "[unused0] " + QUERIES[1])
    assert np.array_equal(
        head.prepare_ids(prompted, "query", prompt_applied=True),
        head.prepare_ids(_bare_ids(colbert, QUERIES[1]), "query"),
    )
    # The model's own limit cuts prompt + text as the reference's tokenizer does: [SEP] kept.
    cut = head.prepare_ids(_bare_ids(colbert, DOCUMENTS[0]), "document", limit=6)
    assert cut.tolist() == _bare_ids(colbert, "[unused1] " + DOCUMENTS[0])[:5] + [102]
    assert spec.reference_similarity == "maxsim" and spec.prefix_insertable


@pytest.fixture(scope="module")
def pylate_dir(colbert, module_tmp) -> Path:
    """The same weights as a PyLate <= 3 save: knobs and prefixes at the top level of
    config_sentence_transformers.json, the markers not registered in the tokenizer."""
    d = module_tmp / "pylate"
    d.mkdir()
    for f in ("config.json", "model.safetensors", "1_Dense", "2_Dense"):
        (d / f).symlink_to(colbert / f)
    _copy_tokenizer(d)  # MiniLM's own: [unused0] is a vocabulary entry, not a special token
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (d / "modules.json").write_text(json.dumps(modules))
    st = {
        "model_type": "ColBERT",
        "query_prefix": "[unused0] ",
        "document_prefix": "[unused1] ",
        "query_length": Q_LEN,
        "document_length": DOC_LEN,
        "attend_to_expansion_tokens": True,
        "prompts": {},
    }
    (d / "config_sentence_transformers.json").write_text(json.dumps(st))
    return d


def test_pylate_layout_reads_as_sentence_transformers_loads_it(pylate_dir, bert, module_tmp):
    head, _ = _check_against_reference(pylate_dir, module_tmp / "out-pylate", bert)
    assert head.spec.query_prefix_ids == [1] and head.spec.normalize


def _body_variant(colbert: Path, d: Path, query_length: int | None = None, **expansion) -> Path:
    """The ColBERT directory with other query expansion settings (and query length cap)."""
    shutil.copytree(colbert, d, symlinks=True)
    cfg = json.loads((d / "sentence_bert_config.json").read_text())
    cfg["query_expansion"].update(expansion)
    if query_length is not None:
        cfg["query_length"] = query_length
    (d / "sentence_bert_config.json").write_text(json.dumps(cfg))
    return d


def test_min_expansion_pads_short_queries_and_keeps_long_ones(colbert, bert, module_tmp):
    """strategy "min": short queries padded to the length, long ones cut only at query_length."""
    d = _body_variant(colbert, module_tmp / "min", query_length=20, strategy="min", length=8)
    head, refs = _check_against_reference(d, module_tmp / "out-min", bert)
    assert [len(v) for v in refs["query"]] == [8, 20, 8]
    assert head.spec.expansion is not None and head.spec.query_length == 20


@pytest.fixture(scope="module")
def stanford_dir(colbert, bert, module_tmp) -> Path:
    """The same encoder as a Stanford-NLP ColBERT checkpoint: `HF_ColBERT`, the encoder's
    weights under `bert.` with the projection `linear.weight` beside them, artifact.metadata."""
    import torch
    from safetensors.torch import save_file

    d = module_tmp / "stanford"
    _copy_tokenizer(d)
    config = json.loads((colbert / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    weights = {f"bert.{k}": v.contiguous() for k, v in bert.state_dict().items()}
    generator = torch.Generator().manual_seed(2)
    weights["linear.weight"] = torch.randn(DIM, HIDDEN, generator=generator) * HIDDEN**-0.5
    save_file(weights, str(d / "model.safetensors"))
    meta = {"query_maxlen": Q_LEN, "doc_maxlen": DOC_LEN, "attend_to_mask_tokens": True}
    (d / "artifact.metadata").write_text(json.dumps(meta))
    return d


def test_stanford_layout_reads_as_sentence_transformers_loads_it(stanford_dir, bert, module_tmp):
    head, _ = _check_against_reference(stanford_dir, module_tmp / "out-stanford", bert)
    spec = head.spec
    assert spec.query_prefix_ids == [1] and spec.document_prefix_ids == [2]
    assert spec.layers[0].bias is False and spec.skiplist_ids


def test_unattended_expansion_needs_an_owned_mask(colbert, bert, module_tmp):
    """attend=False (classic ColBERT): the head still matches the reference on states
    computed under the reference's mask, but only a caller that built that mask is served."""
    d = _body_variant(colbert, module_tmp / "unattended", attend=False)
    head, refs = _check_against_reference(d, module_tmp / "out-unattended", bert, owned=True)
    assert head.needs_owned_mask("query") and not head.needs_owned_mask("document")
    ids = head.prepare_ids(_bare_ids(d, QUERIES[0]), "query")
    with pytest.raises(EngineError) as e:
        head.apply(_states(bert, ids), ids, "query")
    assert e.value.code == "unsupported"
    # Why: attending to the expansion tokens (all llama.cpp can do) is a different model.
    approx = head.apply(_states(bert, ids), ids, "query", owned_mask=True)
    assert _cos(approx, refs["query"][0]).min() < 0.99
    info = ingest_multivector_head(d, module_tmp / "out-unattended-2")
    assert info is not None and info.query_needs_owned_mask


# ---- bge-m3 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bge_m3(module_tmp) -> Path:
    return tiny_bge_m3(module_tmp / "bge-m3")


def tiny_bge_m3(d: Path) -> Path:
    """A tiny seeded bge-m3 in FlagEmbedding's layout: XLM-RoBERTa with `colbert_linear.pt`
    and `sparse_linear.pt` beside it, in `d`."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    from bench.real_sizes import xlmr_tokenizer

    d.mkdir()
    n_vocab = xlmr_tokenizer(d, 256, vocab_size=700)
    torch.manual_seed(1)
    config = XLMRobertaConfig(
        vocab_size=n_vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=258,
        initializer_range=0.3,
    )
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(d)
    torch.save(torch.nn.Linear(HIDDEN, HIDDEN).state_dict(), d / "colbert_linear.pt")
    torch.save(torch.nn.Linear(HIDDEN, 1).state_dict(), d / "sparse_linear.pt")
    # Its sentence-transformers files, as the published bge-m3 has them: CLS pooling, then
    # L2 (what its dense vector is, on every lane).
    prefix = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": prefix + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": prefix + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": prefix + "Normalize"},
    ]
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    (d / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": True}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (d / "2_Normalize").mkdir()
    return d


def _flag_colbert_vecs(d: Path, texts: list[str]) -> list[np.ndarray]:
    """BGEM3FlagModel's colbert_vecs, restated: a padded batch through the encoder,
    colbert_linear on every state but the first, masked, normalized, cut to sum(mask) - 1."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, XLMRobertaModel

    tok = AutoTokenizer.from_pretrained(str(d))
    model = XLMRobertaModel.from_pretrained(str(d), add_pooling_layer=False).eval()
    linear = torch.nn.Linear(HIDDEN, HIDDEN)
    linear.load_state_dict(torch.load(d / "colbert_linear.pt", map_location="cpu"))
    inputs = tok(texts, truncation=True, max_length=256, padding=True, return_tensors="pt")
    with torch.inference_mode():
        last = model(**inputs, return_dict=True).last_hidden_state
        vecs = linear(last[:, 1:]) * inputs["attention_mask"][:, 1:][:, :, None].float()
        vecs = F.normalize(vecs, dim=-1).numpy()
    counts = inputs["attention_mask"].sum(1).numpy()
    return [v[: n - 1] for v, n in zip(vecs, counts, strict=True)]


def test_bge_m3_head_matches_flagembedding(bge_m3, module_tmp):
    from transformers import XLMRobertaModel

    info = ingest_multivector_head(bge_m3, module_tmp / "out-m3")
    assert info is not None and info.kind == "bge-m3" and info.dims == HIDDEN
    assert info.reference_similarity == "meanmaxsim" and not info.query_needs_owned_mask
    head = load(module_tmp / "out-m3" / "heads")
    encoder = XLMRobertaModel.from_pretrained(str(bge_m3), add_pooling_layer=False).eval()
    want = _flag_colbert_vecs(bge_m3, QUERIES + DOCUMENTS)
    ours = []
    for text, ref in zip(QUERIES + DOCUMENTS, want, strict=True):
        ids = head.prepare_ids(_bare_ids(bge_m3, text), "document")
        assert ids.tolist() == _bare_ids(bge_m3, text)  # bge-m3 reads the text as tokenized
        got = head.apply(_states(encoder, ids), ids, "document")
        assert len(got) == len(ids) - 1  # every token's vector but CLS's, </s> included
        _same_vectors(got, ref)
        ours.append(got)
    q, d = ours[: len(QUERIES)], ours[len(QUERIES) :]
    wq, wd = want[: len(QUERIES)], want[len(QUERIES) :]
    for i in range(len(q)):
        for j in range(len(d)):
            # M3Embedder.colbert_score: sum of each query vector's best match / len(q).
            score = (wq[i] @ wd[j].T).max(1).sum()
            # A sum of one best match per query vector: its float32 error grows with the
            # query's length (54 vectors summing to 35.26 were 1.1e-5 off), so the bar is
            # per query vector.
            assert abs(maxsim(q[i], d[j]) - score) < 1e-6 * len(wq[i])
            assert abs(mean_maxsim(q[i], d[j]) - score / len(wq[i])) < 1e-6


# ---- the .pt reader ------------------------------------------------------------------------


def test_torch_pt_reads_what_torch_save_wrote(tmp_path):
    import torch

    t = torch.randn(5, 6).to(torch.bfloat16)
    tensors = {"bf16": t, "t": t.float().t(), "slice": t.float()[1:3, 2:5], "f16": t.half()}
    torch.save(tensors, tmp_path / "x.pt")
    got = read_torch_pt(tmp_path / "x.pt")
    assert list(got) == list(tensors)
    for name, want in tensors.items():
        assert np.array_equal(got[name], want.float().numpy()), name


def test_torch_pt_refusals(tmp_path):
    import torch

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    cases = {
        "missing.pt": None,
        "garbage.pt": b"not a zip at all",
        "code.pt": {"x": Payload()},
        "list.pt": [torch.zeros(2)],
    }
    for name, obj in cases.items():
        if isinstance(obj, bytes):
            (tmp_path / name).write_bytes(obj)
        elif obj is not None:
            torch.save(obj, tmp_path / name)
    # A storage the pickle names is missing from the archive.
    torch.save({"w": torch.zeros(3)}, tmp_path / "full.pt")
    with (
        zipfile.ZipFile(tmp_path / "full.pt") as src,
        zipfile.ZipFile(tmp_path / "cut.pt", "w") as dst,
    ):
        for entry in src.namelist():
            if "/data/" not in entry:
                dst.writestr(entry, src.read(entry))
    for name in [*cases, "cut.pt"]:
        with pytest.raises(TorchPtInvalid) as e:
            read_torch_pt(tmp_path / name)
        assert e.value.code == "artifact_invalid" and name in e.value.message


# ---- what ingest and the head refuse -------------------------------------------------------


def _variant(src: Path, dst: Path) -> Path:
    """A copy of `src` whose files are links, so a test can replace one of them."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    return dst


def _replace_json(d: Path, name: str, edit) -> None:
    path = d / name
    data = json.loads(path.read_text())
    path.unlink()
    path.write_text(json.dumps(edit(data)))


def test_ingest_refusals(colbert, bge_m3, tmp_path):
    import torch

    assert ingest_multivector_head(minilm_dir(), tmp_path / "none") is None
    assert detect(bge_m3) == "bge-m3" and detect(colbert) == "colbert"

    def module_list(mods):
        return [*mods, {"idx": 9, "name": "9", "path": "", "type": "x.HierarchicalTokenPooling"}]

    def gelu(cfg):
        return {**cfg, "activation_function": "torch.nn.modules.activation.GELU"}

    def bad_expansion(cfg):
        return {**cfg, "query_expansion": {"strategy": "fixed", "length": 0}}

    unsupported = {
        "modules.json": module_list,
        "1_Dense/config.json": gelu,
    }
    invalid = {
        "sentence_bert_config.json": bad_expansion,
        "2_Dense/config.json": lambda c: {**c, "in_features": 31},
    }
    for i, (name, edit) in enumerate([*unsupported.items(), *invalid.items()]):
        d = _variant(colbert, tmp_path / f"v{i}")
        if "/" in name:
            sub = d / name.split("/")[0]
            sub.unlink()
            _variant(colbert / sub.name, sub)
        _replace_json(d, name, edit)
        kind = UnsupportedMultiVectorHead if name in unsupported else MultiVectorCheckpointInvalid
        with pytest.raises(kind):
            ingest_multivector_head(d, tmp_path / f"out{i}")

    broken = _variant(colbert, tmp_path / "broken")
    (broken / "modules.json").unlink()
    (broken / "modules.json").write_text("[{")
    with pytest.raises(MultiVectorCheckpointInvalid):
        ingest_multivector_head(broken, tmp_path / "out-broken")

    # bge-m3: a colbert_linear that does not read the hidden size, or is no Linear at all.
    for name, state in {
        "narrow": torch.nn.Linear(HIDDEN + 1, HIDDEN).state_dict(),
        "extra": {**torch.nn.Linear(HIDDEN, HIDDEN).state_dict(), "scale": torch.ones(1)},
    }.items():
        d = _variant(bge_m3, tmp_path / f"m3-{name}")
        (d / "colbert_linear.pt").unlink()
        torch.save(state, d / "colbert_linear.pt")
        with pytest.raises(MultiVectorCheckpointInvalid):
            ingest_multivector_head(d, tmp_path / f"out-m3-{name}")


def test_head_refusals(colbert, tmp_path):
    out = tmp_path / "out"
    ingest_multivector_head(colbert, out)
    head = load(out / "heads")
    ids = head.prepare_ids(_bare_ids(colbert, QUERIES[0]), "query")
    for states, side in (
        (np.zeros((len(ids), HIDDEN + 1), np.float32), "query"),
        (np.zeros((len(ids) - 1, HIDDEN), np.float32), "query"),
        (np.zeros((len(ids), HIDDEN), np.float32), "passage"),
    ):
        with pytest.raises(EngineError) as e:
            head.apply(states, ids, side)
        assert e.value.code == "invalid_request"
    with pytest.raises(EngineError):
        head.prepare_ids([101], "query")  # no room for [CLS] ... [SEP]
    with pytest.raises(InvalidRequest) as bad:
        maxsim(np.zeros((2, DIM)), np.zeros((3, DIM + 1)))
    assert bad.value.code == "invalid_request"

    # Files that disagree: a spec naming a wider layer than the weights hold, weights that are
    # not the ones its spec names, a missing file.
    spec = json.loads((out / "heads" / "multivector.json").read_text())
    spec["layers"][1]["out_features"] = DIM + 1
    (out / "heads" / "multivector.json").write_text(json.dumps(spec))
    with pytest.raises(MultiVectorHeadInvalid, match="dense.1.weight"):
        read_head(out / "heads")
    spec["layers"][1]["out_features"] = DIM
    spec["weights_sha256"] = "0" * 64
    (out / "heads" / "multivector.json").write_text(json.dumps(spec))
    with pytest.raises(MultiVectorHeadInvalid, match="sha256"):
        read_head(out / "heads" / "multivector.json")
    (out / "heads" / "multivector.safetensors").unlink()
    with pytest.raises(EngineError) as e:
        load(out / "heads")
    assert e.value.code == "artifact_invalid"


def test_maxsim_of_an_empty_document_as_sentence_transformers_scores_it():
    import torch
    from sentence_transformers.util.similarity import maxsim as st_maxsim
    from sentence_transformers.util.similarity import mean_maxsim as st_mean_maxsim

    q = np.random.default_rng(0).standard_normal((3, DIM)).astype(np.float32)
    empty = np.zeros((0, DIM), np.float32)
    want = st_maxsim([torch.from_numpy(q)], [torch.from_numpy(empty)])
    assert maxsim(q, empty) == pytest.approx(float(want[0, 0]))
    want = st_mean_maxsim([torch.from_numpy(q)], [torch.from_numpy(empty)])
    assert mean_maxsim(q, empty) == pytest.approx(float(want[0, 0]))


# ---- served: the llama.cpp lane ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served_store(colbert, bge_m3, module_tmp):
    from ingest.store import ArtifactStore

    store = ArtifactStore(module_tmp / "models")
    store.ingest_hf_dir(colbert, "colbert", dtype="f32")
    store.ingest_hf_dir(bge_m3, "bge-m3", dtype="f32", pooling="cls")  # bge-m3 pools CLS
    return store


def _module(store, runtime_dir, **host):
    from host.config import HostConfig
    from host.module import Module, ModuleConfig

    host_config = HostConfig(runtime_dir=runtime_dir, ping_interval_s=0, **host)
    return Module(ModuleConfig(store_root=str(store.root), host=host_config))


async def test_the_llama_lane_serves_colbert_like_multivectorencoder(
    served_store, colbert, short_runtime_dir
):
    """Ingested from its directory and served: documents' and queries' vectors as
    `MultiVectorEncoder.encode` gives them (prefix, expansion, skiplist, Dense, normalize), and
    rerank by raw MaxSim as its `similarity` scores."""
    from sentence_transformers import MultiVectorEncoder

    from common.errors import InvalidRequest

    ref = MultiVectorEncoder(str(colbert), device="cpu")
    manifest = served_store.get("colbert").manifest
    assert manifest.outputs == ["multivector", "tokens"] and "multivector" in manifest.heads
    # What the host sizes its requests by: a query padded to its expansion, a prefix id added.
    head = manifest.heads["multivector"]
    assert (head.prefix_rows, head.expansion_rows) == (1, Q_LEN)
    async with _module(served_store, short_runtime_dir) as mod:
        docs = await mod.encode_outputs(DOCUMENTS, ["multivector"], "colbert")
        queries = await mod.encode_outputs(QUERIES, ["multivector"], "colbert", side="query")
        ranked = await mod.rerank(QUERIES[0], DOCUMENTS, "colbert")
        with pytest.raises(InvalidRequest, match="no dense output"):
            await mod.embed(["a"], "colbert")
    ref_docs = ref.encode_document(DOCUMENTS)
    ref_queries = ref.encode_query(QUERIES)
    worst = 1.0
    pairs = [*zip(docs.multivector, ref_docs, strict=True)]
    pairs += [*zip(queries.multivector, ref_queries, strict=True)]
    for got, want in pairs:
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape
        worst = min(worst, float(_cos(got, want).min()))
    print(f"worst multi-vector cos on the llama lane {worst:.7f}")
    assert worst >= 0.9999
    want_scores = np.asarray(ref.similarity(ref_queries[:1], ref_docs), np.float64)[0]
    got_scores = dict(ranked.results)
    assert ranked.method == "multi-vector-maxsim"
    assert max(abs(got_scores[i] - want_scores[i]) for i in range(len(DOCUMENTS))) < 1e-3


# A frame that holds one long text's three outputs, but not six texts' sparse replies were a
# sparse vector as wide as the vocabulary.
FRAME = 32768


async def test_bge_m3_gives_dense_sparse_and_multi_vector_from_one_pass(
    served_store, bge_m3, short_runtime_dir, monkeypatch
):
    """bge-m3 served: its CLS vector, lexical weights and colbert vectors as FlagEmbedding's
    formulas compute them on transformers, all three from one ENCODE."""
    from common.errors import InvalidRequest
    from host import token_outputs

    texts = QUERIES + DOCUMENTS
    manifest = served_store.get("bge-m3").manifest
    assert set(manifest.heads) == {"sparse", "multivector"} and manifest.outputs == []
    # Lexical weights hold one entry per distinct token, never the whole vocabulary: the
    # host sizes its requests by that, so a small frame still carries every text at once.
    assert manifest.heads["sparse"].entries_per_token
    assert len(texts) * 2 * 4 * manifest.heads["sparse"].dims > FRAME
    plans = []
    plan = token_outputs.plan_chunks
    monkeypatch.setattr(
        token_outputs, "plan_chunks", lambda *a: plans.append(plan(*a)) or plans[-1]
    )
    async with _module(served_store, short_runtime_dir, max_frame=FRAME) as mod:
        got = await mod.encode_outputs(texts, ["dense", "sparse", "multivector"], "bge-m3")
        sparse_alone = await mod.encode_outputs(texts, ["sparse"], "bge-m3")
        lane = mod.supervisor("bge-m3")
        pid = lane.state().pid
        # A reply that could outgrow the frame is refused before it is asked for: the
        # worker lives on and the lane takes no strike.
        with pytest.raises(InvalidRequest, match="over the 32768-byte protocol frame"):
            await mod.encode_outputs(texts, ["tokens", "multivector"], "bge-m3")
        assert lane.state().strikes == 0
        again = await mod.encode_outputs(texts[:1], ["sparse"], "bge-m3")
        assert lane.state().pid == pid and lane.state().restarts == 0
    assert len(plans[0]) > 1 and len(plans[1]) == 1  # the sparse replies in one request
    assert again.sparse is not None and sparse_alone.sparse is not None
    dense, colbert_vecs, lexical = _bge_m3_references(bge_m3, texts)
    assert got.dense is not None and _cos(got.dense, dense).min() >= 0.9999
    for ours, ref in zip(got.multivector or [], colbert_vecs, strict=True):
        assert ours.shape == ref.shape and _cos(ours, ref).min() >= 0.9999
    sparse = [*(got.sparse or []), *sparse_alone.sparse, *again.sparse]
    for (idx, val), ref in zip(sparse, lexical * 2 + lexical[:1], strict=True):
        assert [str(i) for i in idx] == sorted(ref, key=int)
        want = np.array([ref[str(i)] for i in idx], np.float32)
        assert np.max(np.abs(val - want) / want) <= 0.10
        assert _cos(val[None], want[None])[0] >= 0.9999


def _bge_m3_references(bge_m3: Path, texts: list[str]):
    """bge-m3's three outputs of `texts` as FlagEmbedding computes them on transformers: the
    normalized CLS state, `colbert_vecs` and the lexical weights (by id string)."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    from tests.test_sparse_heads import _flag_embedding_lexical_weights

    tok = AutoTokenizer.from_pretrained(str(bge_m3))
    model = XLMRobertaModel.from_pretrained(str(bge_m3), add_pooling_layer=False).eval()
    with torch.inference_mode():
        cls = [model(**tok(t, return_tensors="pt")).last_hidden_state[0, 0].numpy() for t in texts]
    dense = np.stack([v / np.linalg.norm(v) for v in cls])
    return (
        dense,
        _flag_colbert_vecs(bge_m3, texts),
        _flag_embedding_lexical_weights(bge_m3, texts, 256),
    )


def test_one_encode_is_one_forward_pass(served_store, monkeypatch):
    """The engine decodes the texts once for any set of outputs: three outputs asked
    together cost the decodes of one, where three requests cost three times as many."""
    from tests.test_llama_engine import _load
    from workers.engine import NullProgress
    from workers.llama import native
    from workers.llama.engine import LlamaEngine
    from workers.protocol import messages as m

    record = served_store.get("bge-m3")
    heads = {
        kind: {"path": str(record.dir / h.file), "digest": h.digest}
        for kind, h in record.manifest.heads.items()
    }
    from host.tokenization import Tokenizer

    assert record.tokenizer_path is not None
    tokenizer = Tokenizer.from_file(str(record.tokenizer_path), max_tokens=64)

    def tok(text: str) -> np.ndarray:
        return tokenizer.encode([text], truncate=True).ids[0]

    from workers.llama import output_buffer

    engine = LlamaEngine()
    decodes = []
    decode = native.decode
    monkeypatch.setattr(native, "decode", lambda slot, b: (decodes.append(1), decode(slot, b)))
    released = []  # the logits pages an encoder never writes go back after each decode
    release = output_buffer.release_logits
    monkeypatch.setattr(output_buffer, "release_logits", lambda c: released.append(release(c)))
    try:
        ref = _load(engine, record.artifact_path, "m3", kind="embed", pooling="cls", heads=heads)
        ids = [tok(t) for t in QUERIES + DOCUMENTS]

        def encode(outputs) -> int:
            decodes.clear()
            req = m.ENCODE(
                req_id=1,
                model_ref=ref.model_ref,
                items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
                outputs=outputs,
            )
            engine.encode(req, np.concatenate(ids), NullProgress())
            return len(decodes)

        one = encode(["dense", "sparse", "multivector"])
        apart = sum(encode([k]) for k in ("dense", "sparse", "multivector"))
    finally:
        engine.close()
    assert one >= 1 and apart == 3 * one
    if sys.platform.startswith("linux"):
        assert len(released) == 4 * one and min(released) > 0


# ---- served: the Core ML lane -----------------------------------------------------------------

# The lane's fp16 bar (certification.thresholds, ("ane", "fp16")): every vector's cosine.
ANE_MIN_COS = 0.9995


def _ane_extra(module_tmp: Path, seq_len: int = 64, packed: bool = False) -> dict:
    """The Core ML lane on the reference executor, one unpacked shape (or one packed shape of
    two rows, four segments a row), one compile cache for the module (the ColBERT variants
    share the encoder and the projection: cache hits)."""
    shape: dict = {"rows": 4, "seq_len": seq_len}
    if packed:
        shape = {"rows": 2, "seq_len": seq_len, "packed": True, "max_segments": 4}
    return {"backend": "reference", "cache_root": str(module_tmp / "ane-cache"), "shapes": [shape]}


@pytest.fixture(scope="module")
def blind_dir(served_store, colbert, module_tmp) -> Path:
    """A classic ColBERT: its query expansion is not attended, served as `colbert-blind`."""
    d = _body_variant(colbert, module_tmp / "ane-blind", attend=False)
    served_store.ingest_hf_dir(d, "colbert-blind", dtype="f32")
    return d


async def test_the_core_ml_lane_serves_colbert_and_the_queries_llama_cpp_cannot(
    served_store, colbert, blind_dir, module_tmp, short_runtime_dir
):
    """The Core ML graph projects every token (the Dense layers as 1x1 convs, normalized per
    token) and the worker keeps the reference's tokens with the llama lane's code. Its own
    attention mask serves what llama.cpp refuses: a classic ColBERT's query expansion, hidden
    from every position, itself included. At the lane's fp16 bar against
    `MultiVectorEncoder`, and raw MaxSim as its `similarity` scores."""
    from sentence_transformers import MultiVectorEncoder

    from host.errors import WorkerError

    async with _module(served_store, short_runtime_dir) as mod:
        for name in ("colbert", "colbert-blind"):
            await mod.load(name, "ane", _ane_extra(module_tmp))
        docs = await mod.encode_outputs(DOCUMENTS, ["multivector"], "colbert", lane="ane")
        queries = await mod.encode_outputs(
            QUERIES, ["multivector"], "colbert", lane="ane", side="query"
        )
        blind = await mod.encode_outputs(
            QUERIES, ["multivector"], "colbert-blind", lane="ane", side="query"
        )
        with pytest.raises(WorkerError, match="cannot express that mask") as refused:
            await mod.encode_outputs(
                QUERIES, ["multivector"], "colbert-blind", lane="llama", side="query"
            )
        assert refused.value.code == "unsupported"
        # Each worker declared at LOAD what it refuses whatever the items: the llama.cpp
        # lane this query side, with the reason its ERR gave; the Core ML lane nothing.
        (declared,) = mod.refusals("colbert-blind", "llama")
        assert (declared.output, declared.side) == ("multivector", "query")
        assert declared.reason in refused.value.message
        assert mod.refusals("colbert-blind", "ane") == ()
        assert mod.refusals("colbert", "llama") == ()  # its expansion is attended
    ref = MultiVectorEncoder(str(colbert), device="cpu")
    ref_docs, ref_queries = ref.encode_document(DOCUMENTS), ref.encode_query(QUERIES)
    ref_blind = MultiVectorEncoder(str(blind_dir), device="cpu").encode_query(QUERIES)
    worst = 1.0
    for got, want in [
        *zip(docs.multivector or [], ref_docs, strict=True),
        *zip(queries.multivector or [], ref_queries, strict=True),
        *zip(blind.multivector or [], ref_blind, strict=True),
    ]:
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape  # the same tokens kept, expansion included
        worst = min(worst, float(_cos(got, want).min()))
    # Hiding the expansion is a different model: the attended queries are not its vectors.
    assert _cos(blind.multivector[0], np.asarray(ref_queries[0])).min() < 0.99  # type: ignore[index]
    ours = np.array([[maxsim(q, d) for d in docs.multivector] for q in queries.multivector])  # type: ignore[union-attr]
    want_scores = np.asarray(ref.similarity(ref_queries, ref_docs), np.float64)
    err = float(np.abs(ours - want_scores).max())
    print(f"Core ML lane ColBERT: worst vector cos {worst:.6f}, MaxSim max |diff| {err:.2e}")
    assert worst >= ANE_MIN_COS
    # Each query vector's best dot product carries both unit vectors' fp16 error (~1e-3):
    # the sum over Q_LEN of them is held to 2e-3 a query vector (measured 1.6e-2 over 16).
    assert err <= 2e-3 * Q_LEN

    # Packed rows (the lane admitted with a packed shape only): several items to a row, each
    # its own segment. The hidden expansion stays hidden (the key mask within the segment),
    # and a query alone in its row gives what it gives packed with the others.
    async with _module(served_store, short_runtime_dir) as mod:
        for name in ("colbert", "colbert-blind"):
            await mod.load(name, "ane", _ane_extra(module_tmp, packed=True))
        p_docs = await mod.encode_outputs(DOCUMENTS, ["multivector"], "colbert", lane="ane")
        p_queries = await mod.encode_outputs(
            QUERIES, ["multivector"], "colbert", lane="ane", side="query"
        )
        p_blind = await mod.encode_outputs(
            QUERIES, ["multivector"], "colbert-blind", lane="ane", side="query"
        )
        alone = await mod.encode_outputs(
            QUERIES[:1], ["multivector"], "colbert-blind", lane="ane", side="query"
        )
    packed_worst = 1.0
    for got, want in [
        *zip(p_docs.multivector or [], ref_docs, strict=True),
        *zip(p_queries.multivector or [], ref_queries, strict=True),
        *zip(p_blind.multivector or [], ref_blind, strict=True),
    ]:
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape
        packed_worst = min(packed_worst, float(_cos(got, want).min()))
    own = float(_cos(alone.multivector[0], p_blind.multivector[0]).min())  # type: ignore[index]
    print(f"packed rows: worst vector cos {packed_worst:.6f}; a query alone vs packed {own:.7f}")
    assert packed_worst >= ANE_MIN_COS and own >= 0.99999


def _listed_lanes_policy(root: Path, ane_extra: dict, curves: dict):
    """The serve config's `lanes = ["ane", "llama"]` for a model with no certificate (the
    certificate policy's answer: agreement measured at load), with this module's Core ML
    shapes (on the reference executor its default shapes take minutes to compile) and latency
    curves whose answer is known."""
    import dataclasses

    from certification.lane_policy import CertificateLanePolicy
    from certification.store import CertificateStore
    from host.lane_policy import LaneSet

    class Listed(CertificateLanePolicy):
        def lane_set(self, model: str, lanes: list[str] | None) -> LaneSet | str:
            got = super().lane_set(model, lanes)
            assert isinstance(got, LaneSet) and got.agreement is None, got
            return dataclasses.replace(got, runtime_config_extra={"ane": ane_extra}, curves=curves)

    return Listed(CertificateStore(root), agreement_stride=40)  # 9 corpus items


async def test_a_colbert_on_two_lanes_sends_the_queries_llama_cpp_cannot_mask_to_core_ml(
    served_store, blind_dir, module_tmp, short_runtime_dir
):
    """A classic ColBERT served by both lanes: they agree on documents (measured at load: every
    multi-vector's cosine), the llama.cpp worker declared at load that it refuses the query
    side. With llama.cpp the faster lane at every size, documents go to it by the size rule,
    and queries (and a MaxSim rerank, which reads both sides on one lane) to the Core ML lane,
    which serves them as `MultiVectorEncoder` computes them."""
    from sentence_transformers import MultiVectorEncoder

    from host.config import HostConfig
    from host.lane_router import Ask, LatencyCurve
    from host.module import Module, ModuleConfig

    items = [1, 4, 16, 64]
    curves = {
        "ane": LatencyCurve(items=items, seconds=[0.02, 0.08, 0.32, 1.28]),
        "llama": LatencyCurve(items=items, seconds=[0.01, 0.011, 0.014, 0.03]),
    }
    name = "colbert-blind"
    policy = _listed_lanes_policy(module_tmp / "no-certs", _ane_extra(module_tmp), curves)
    config = ModuleConfig(
        store_root=str(served_store.root),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
        model_lanes={name: ["ane", "llama"]},
    )
    async with Module(config, policy) as mod:
        docs = await mod.encode_outputs(DOCUMENTS, ["multivector"], name)
        choice = mod.chosen_lanes()[name]
        assert choice.lanes == ("ane", "llama"), choice.reason
        assert "measured at load" in choice.reason
        print(f"two-lane ColBERT: {choice.reason}")
        assert mod.refusals(name, "llama")[0].side == "query"
        assert docs.lane == "llama"  # the size rule: nothing refused
        queries = await mod.encode_outputs(QUERIES, ["multivector"], name, side="query")
        assert queries.lane == "ane"  # the only lane that serves it
        assert mod.pick_lane(name, 64, Ask(("multivector",), ("query",))) == "ane"
        assert mod.pick_lane(name, 1, Ask(("multivector",), ("document",))) == "llama"
        ranked = await mod.rerank(QUERIES[0], DOCUMENTS, name)
        assert ranked.lane == "ane" and ranked.method == "multi-vector-maxsim"
    ref = MultiVectorEncoder(str(blind_dir), device="cpu")
    ref_docs, ref_queries = ref.encode_document(DOCUMENTS), ref.encode_query(QUERIES)
    for got, want in [
        *zip(docs.multivector or [], ref_docs, strict=True),
        *zip(queries.multivector or [], ref_queries, strict=True),
    ]:
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape and _cos(got, want).min() >= ANE_MIN_COS
    want_scores = np.asarray(ref.similarity(ref_queries[:1], ref_docs), np.float64)[0]
    got_scores = dict(ranked.results)
    err = max(abs(got_scores[i] - want_scores[i]) for i in range(len(DOCUMENTS)))
    assert err <= 2e-3 * Q_LEN  # the Core ML lane's fp16 bar, as above


async def test_the_core_ml_lane_gives_bge_m3s_three_outputs_from_one_pass(
    served_store, bge_m3, module_tmp, short_runtime_dir
):
    """bge-m3 on the Core ML lane: dense, lexical weights and colbert vectors of one ENCODE,
    against FlagEmbedding's formulas at the lane's fp16 bar; the engine runs one prediction
    per chunk of rows whichever outputs are asked."""
    from ingest.owned import ensure_owned
    from workers.ane.engine import AneEngine
    from workers.engine import NullProgress
    from workers.protocol import messages as m

    texts = QUERIES + DOCUMENTS
    async with _module(served_store, short_runtime_dir) as mod:
        await mod.load("bge-m3", "ane", _ane_extra(module_tmp, 128))
        got = await mod.encode_outputs(
            texts, ["dense", "sparse", "multivector"], "bge-m3", lane="ane"
        )
        ids = (await mod.tokenizer("bge-m3")).encode(texts, truncate=True).ids
    dense, colbert_vecs, lexical = _bge_m3_references(bge_m3, texts)
    assert got.dense is not None
    dense_cos = float(_cos(got.dense, dense).min())
    mv_cos = min(
        float(_cos(ours, ref).min())
        for ours, ref in zip(got.multivector or [], colbert_vecs, strict=True)
    )
    for ours, ref in zip(got.multivector or [], colbert_vecs, strict=True):
        assert ours.shape == ref.shape
    worst_abs, worst_sparse_cos = 0.0, 1.0
    for (idx, val), ref in zip(got.sparse or [], lexical, strict=True):
        want = np.zeros(700, np.float32)
        want[[int(k) for k in ref]] = list(ref.values())
        mine = np.zeros(700, np.float32)
        mine[idx] = val
        # fp16 moves a weight by a few 1e-3: an id whose weight is that close to 0 may be
        # active on one side only; every other id is active on both.
        assert np.all(np.abs(mine - want)[(mine > 0) != (want > 0)] <= 1e-2)
        worst_abs = max(worst_abs, float(np.abs(mine - want).max()))
        worst_sparse_cos = min(worst_sparse_cos, float(_cos(mine[None], want[None])[0]))
    print(
        f"Core ML lane bge-m3: dense cos {dense_cos:.6f}, colbert cos {mv_cos:.6f}, "
        f"lexical weights max |diff| {worst_abs:.2e}, sparse cos {worst_sparse_cos:.6f}"
    )
    assert dense_cos >= ANE_MIN_COS and mv_cos >= ANE_MIN_COS
    assert worst_sparse_cos >= ANE_MIN_COS and worst_abs <= 1e-2
    # The same from packed rows: the lexical weights and colbert vectors sliced per segment.
    async with _module(served_store, short_runtime_dir) as mod:
        await mod.load("bge-m3", "ane", _ane_extra(module_tmp, 128, packed=True))
        packed = await mod.encode_outputs(
            texts, ["dense", "sparse", "multivector"], "bge-m3", lane="ane"
        )
    assert packed.dense is not None
    p_dense = float(_cos(packed.dense, dense).min())
    p_mv = 1.0
    for ours, ref in zip(packed.multivector or [], colbert_vecs, strict=True):
        assert ours.shape == ref.shape
        p_mv = min(p_mv, float(_cos(ours, ref).min()))
    p_abs = 0.0
    for (idx, val), (u_idx, u_val) in zip(packed.sparse or [], got.sparse or [], strict=True):
        # Packed and unpacked rows give the same weights to within fp16 (a weight within
        # fp16 noise of 0 may be active on one side only).
        mine, theirs = np.zeros(700, np.float32), np.zeros(700, np.float32)
        mine[idx], theirs[u_idx] = val, u_val
        p_abs = max(p_abs, float(np.abs(mine - theirs).max()))
    print(
        f"packed rows: dense cos {p_dense:.6f}, colbert cos {p_mv:.6f}, lexical weights vs "
        f"unpacked max |diff| {p_abs:.2e}"
    )
    assert p_dense >= ANE_MIN_COS and p_mv >= ANE_MIN_COS and p_abs <= 1e-2

    # One forward: the worker's engine in process, on the module's compiled shape (a cache
    # hit), counting predictions.
    record = served_store.get("bge-m3")
    owned, digest = ensure_owned(served_store, record)
    heads = {
        kind: {"path": str(record.dir / h.file), "digest": h.digest}
        for kind, h in record.manifest.heads.items()
    }
    engine = AneEngine(owned, backend="reference")
    engine.load(
        m.LOAD(
            req_id=1,
            artifact_path=str(owned),
            artifact_digest=digest,
            format="coreml-owned",
            runtime_config={"model_ref": "m3", "heads": heads, **_ane_extra(module_tmp, 128)},
        ),
        NullProgress(),
    )
    try:
        runs = []
        compiled = next(iter(engine._model.shapes.values()))  # type: ignore[union-attr]
        run = compiled.runner.run
        compiled.runner.run = lambda feeds: (runs.append(1), run(feeds))[1]  # type: ignore[method-assign]

        def encode(outputs) -> int:
            runs.clear()
            req = m.ENCODE(
                req_id=2,
                model_ref="m3",
                items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
                outputs=outputs,
            )
            engine.encode(req, np.concatenate(ids), NullProgress())
            return len(runs)

        one = encode(["dense", "sparse", "multivector"])
        apart = sum(encode([k]) for k in ("dense", "sparse", "multivector"))
    finally:
        engine.close()
    assert one == 2 and apart == 3 * one  # 6 texts in rows of 4

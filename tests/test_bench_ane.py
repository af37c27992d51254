"""bench.ane's logic on tiny models, one trial and a few inputs: the JSON has every key of the
BERT run (packed gain, executor cost, cold / warm admit) for the other families too, says
which model, shapes and reference ran, and the packed and unpacked shapes agree. This checks
the bench, not the executor's speed."""

from __future__ import annotations

import json

import pytest

from bench.ane import Subject, main, run_model, run_real_size, run_store_model, shapes_for
from bench.real_sizes import SHAPES, ensure_dir
from certification.reference.cross_encoder import build_test_cross_encoder
from formats.owned.manifest import ingest_owned
from ingest.store import ArtifactStore
from tests.hub_support import tiny_bert_dir

pytestmark = pytest.mark.model

TINY = {
    "xlmr": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 8000,
    },
    "qwen3": {
        "num_hidden_layers": 2,
        "max_window_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 3000,
    },
}
SMALL = {"sentences": 8, "rows": 2, "seq_len": 64, "start": False}
# Every run's keys (the BERT run's, which stay, and those every family adds).
KEYS = {
    "executor_ratio",
    "executor_ratio_unpacked",
    "executor_token_ratio",
    "executor_sentences_per_s",
    "executor_unpacked_sentences_per_s",
    "reference_sentences_per_s",
    "reference_impl",
    "sentences",
    "mean_tokens",
    "packed_gain",
    "packed_gain_tokens",
    "packed_sentences_per_s",
    "unpacked_sentences_per_s",
    "packed_vs_unpacked_max_abs_diff",
    "short_inputs",
    "executor_s_per_prediction",
    "cold_compile_admit_ms",
    "cached_admit_ms",
    "admit_speedup",
    "admit",
    "start",
    "shapes",
    "shape_note",
    "trials",
    "model",
    "machine",
}


def _check(result: dict, family: str, head: str, tol: float) -> None:
    assert KEYS <= set(result), KEYS - set(result)
    json.dumps(result)  # all of it is JSON
    model = result["model"]
    assert (model["family"], model["head"], result["trials"]) == (family, head, 1)
    assert model["parameters"] > 0 and model["layers"] == 2
    assert result["shapes"] == {"unpacked": "2x64", "packed": "2x64p4"}
    assert result["shape_note"].startswith("2x64 / 2x64p4")
    assert result["sentences"] == 8 and result["short_inputs"]["sentences"] == 8
    # 8 sixteen-token inputs: 4 unpacked predictions of 2 rows, 1 packed of 2 rows x 4.
    assert result["short_inputs"] == {
        "sentences": 8,
        "tokens": 16,
        "predictions": {"unpacked": 4, "packed": 1},
    }
    for key in (
        "packed_gain",
        "executor_ratio",
        "executor_ratio_unpacked",
        "executor_token_ratio",
        "admit_speedup",
        "reference_sentences_per_s",
    ):
        assert result[key] > 0, key
    assert set(result["executor_s_per_prediction"]) == {"unpacked", "packed"}
    assert min(result["executor_s_per_prediction"].values()) > 0
    assert "sentence-transformers" in result["reference_impl"]
    assert result["executor_vs_reference"]["min_cos"] >= 0.99, result["executor_vs_reference"]
    assert result["packed_vs_unpacked_max_abs_diff"] <= tol
    admit = result["admit"]
    assert admit["cold"]["build_ms"] > 0 and admit["cold"]["compile_ms"] > 0
    assert admit["warm_hit"]["build_ms"] == admit["warm_hit"]["compile_ms"] == 0.0
    assert admit["package_hit_ms"] > 0 and admit["packed_cold_load_ms"] > 0
    assert result["cold_compile_admit_ms"] == admit["cold"]["total_ms"]
    assert result["start"] == {"skipped": "--skip-start"}
    before, after = result["machine"]["before"], result["machine"]["after"]
    assert len(before["load_average"]) == len(after["load_average"]) == 3


def test_qwen3_at_a_tiny_config_through_the_real_size_path(tmp_path):
    result = run_real_size(
        "qwen3",
        tmp_path / "work",
        1,
        root=tmp_path,
        config={**SHAPES["qwen3"].config, **TINY["qwen3"]},
        **SMALL,
    )
    _check(result, "qwen3", "embed_last", 1e-3)
    assert result["model"]["pooling"] == "last"
    assert result["real_size"]["shape_of"] == "Qwen/Qwen3-Embedding-0.6B"
    assert result["real_size"]["config_overridden"] is True
    assert "as asked" in result["shape_note"]


def test_xlmr_from_the_store_by_name(tmp_path):
    hf_dir = ensure_dir(SHAPES["xlmr"], tmp_path, {**SHAPES["xlmr"].config, **TINY["xlmr"]})
    store = ArtifactStore(tmp_path / "store" / "models")
    store.ingest_hf_dir(hf_dir, "tiny-e5")
    result = run_store_model("tiny-e5", tmp_path / "work", 1, store_root=str(store.root), **SMALL)
    _check(result, "xlm-roberta", "embed_mean", 1e-3)
    assert result["model"]["name"] == "tiny-e5"
    assert result["model"]["source"] == f"hf-dir:{hf_dir}"
    # The artifact measured is the one the lane loads: the store's owned build.
    assert (store.root.parent / "owned").is_dir()


def test_a_cross_encoder_scores_pairs(tmp_path):
    # The test cross-encoder's seeded head on a tiny BERT (2 layers, width 96): the BERT
    # cross-encoder path of the bench, at a fraction of MiniLM's compile and executor cost.
    xenc = build_test_cross_encoder(
        tmp_path / "xenc", seed=0, backbone_dir=tiny_bert_dir(tmp_path / "tiny-bert")
    )
    manifest = ingest_owned(xenc, tmp_path / "owned")
    up, pk = shapes_for(manifest, 2, 64)
    subject = Subject(
        manifest,
        xenc,
        "test-ce",
        "test",
        up,
        pk,
        8,
        "2x64 / 2x64p4 (as asked)",
    )
    result = run_model(subject, tmp_path / "work", 1, start=False)
    assert result["model"]["head"] == "cross_encoder"
    assert result["reference_impl"].startswith("numpy fp32 BERT")
    assert result["executor_ratio"] > 0 and result["packed_gain"] > 0
    assert result["packed_vs_unpacked_max_abs_diff"] <= 0.05  # logits, not unit vectors
    agree = result["executor_vs_reference"]
    assert agree["max_abs_diff"] <= 0.05 * max(agree["reference_std"], 1.0), agree


def test_the_cli_writes_the_json_it_prints(tmp_path, capsys):
    # The default model (BERT) at a small shape; --out has the printed object.
    out = tmp_path / "ane.json"
    assert (
        main(
            [
                "--trials",
                "1",
                "--sentences",
                "8",
                "--rows",
                "2",
                "--seq-len",
                "64",
                "--skip-start",
                "--dir",
                str(tmp_path / "work"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert KEYS <= set(printed), KEYS - set(printed)
    assert printed["model"]["family"] == "bert"
    assert printed["reference_impl"].startswith("numpy fp32 BERT")
    assert printed["shapes"] == {"unpacked": "2x64", "packed": "2x64p4"}

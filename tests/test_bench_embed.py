"""bench.embed's logic on tiny models, one repeat and a few texts: the JSON says what ran, the
cosines between the contenders are computed (this checks the bench, not the lane's speed),
and a model without a Hugging Face directory skips the baselines with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.embed import (
    _onnx_runtime,
    _sentence_transformers,
    bench_texts,
    resolve_target,
    run_bench,
)
from ingest.store import DEFAULT_EMBED, Manifest, ModelRecord

# A 2-layer Qwen3 at width 64 with the real shape's tokenizer, pooling, Normalize and prompts.
TINY_QWEN3 = {
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 3000,
}


def _check_cosines(result: dict) -> None:
    assert result["embed"]["lane_min_cos_vs_in_process"] >= 0.9999
    st, ort = result["sentence_transformers"], result["ort"]
    assert "skipped" not in st and "skipped" not in ort, (st, ort)
    for value in (
        st["lane_mean_cos_vs_sentence_transformers"],
        st["lane_min_cos_vs_sentence_transformers_same_ids"],
        ort["lane_min_cos_vs_ort_same_ids"],
        ort["ort_min_cos_vs_sentence_transformers"],
    ):
        assert 0.999 <= value <= 1.000001, result
    assert st["lane_ratio_vs_sentence_transformers"] > 0 and ort["lane_vs_ort"] > 0
    _check_kernels(result)


def _check_kernels(result: dict) -> None:
    """The in-process engine runs on the OpenBLAS kernels the lane's workers get: no loaded
    OpenBLAS is left on a fallback the kernel rule would replace (it must be applied before
    anything in the bench process loads llama_cpp)."""
    import sys

    from workers.llama import openblas_core as oc

    ran = result["kernels"]
    assert ran["choice"].startswith("openblas: ")
    st, ort = result["sentence_transformers"], result["ort"]
    if "skipped" not in st:  # torch picks its own kernels: the report names them
        assert ran["sentence_transformers"]["cpu_capability"]
    if "skipped" not in ort:
        assert ran["ort"]["providers"] == ["CPUExecutionProvider"]
    if not sys.platform.startswith("linux"):
        return
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        flags = oc.cpu_flags(f.read())
    for lib, core in result["openblas_core"].items():
        assert oc.choose(core, flags, {}) is None, (lib, core)
    # The lane's worker, read from its own process, runs what the in-process engine runs.
    worker, here = ran["lane_worker"], ran["in_process"]
    assert worker["pid"] != here["pid"] and ran["same"] is True
    assert here["openblas"] == result["openblas_core"]
    shared = set(worker["openblas"]) & set(here["openblas"])
    assert shared or oc.library() is None, ran  # both map the system OpenBLAS (BLAS build)
    for lib in shared:
        assert worker["openblas"][lib] == here["openblas"][lib], (lib, ran)
        assert oc.choose(worker["openblas"][lib], flags, {}) is None, (lib, ran)


def test_texts_are_fixed_and_can_be_kept_short():
    assert bench_texts(20) == bench_texts(20)
    short = bench_texts(30, max_chars=80)
    assert len(short) == 30 and max(map(len, short)) <= 80
    assert len(set(short)) > 20  # cycled through the corpus, not one item repeated
    with pytest.raises(ValueError, match="no corpus item"):
        bench_texts(3, max_chars=0)


def test_a_gguf_ingested_model_skips_both_baselines_with_the_reason():
    man = Manifest(
        name="g-minilm",
        format="gguf",
        kind="embed",
        digest="0" * 64,
        size_bytes=1,
        dims=384,
        n_ctx=512,
        n_ctx_train=512,
        max_tokens=256,
        max_tokens_limit=512,
        source="gguf:/models/minilm.gguf",
        created_at="now",
        pooling="mean",
    )

    class Store:
        root = Path("/nonexistent/models")

        def get(self, name):
            return ModelRecord(man, Path("/nonexistent"))

    target = resolve_target(Store(), "g-minilm", None)
    assert target.hf_dir is None and target.prompt == ""
    for run, why in (_sentence_transformers(2, target), _onnx_runtime(2, target, Store())):
        assert run is None
        assert "gguf:/models/minilm.gguf" in why and "no Hugging Face directory" in why


@pytest.mark.model
def test_the_default_model_one_repeat(store_root):
    result = run_bench(DEFAULT_EMBED, repeats=1, threads=2, store_root=store_root, sentences=12)
    assert (result["model"], result["sentences"], result["repeats"]) == (DEFAULT_EMBED, 12, 1)
    assert (result["pooling"], result["dims"], result["prompt"]) == ("mean", 384, "")
    assert set(result["seconds_per_repeat"]) == {
        "lane",
        "in_process",
        "sentence_transformers",
        "ort",
    }
    assert result["plan"]["embed_batches"] >= 1 and result["plan"]["decodes"] >= 1
    assert result["tokens"] == sum(result["plan"]["tokens_per_batch"])
    _check_cosines(result)


@pytest.mark.model
def test_a_last_token_model_with_a_prompt(tmp_path):
    from ingest.hf_dir import FAMILIES

    if "qwen3" not in FAMILIES:
        pytest.skip("no Qwen3 converter in ingest.hf_dir yet")
    from bench.real_sizes import QWEN3_PROMPTS, SHAPES, run_shape

    shape = SHAPES["qwen3"]
    result = run_shape(
        shape,
        1,
        threads=2,
        root=tmp_path,
        config={**shape.config, **TINY_QWEN3},
        sentences=10,
        prompt_name="query",
    )
    assert (result["pooling"], result["dims"], result["sentences"]) == ("last", 64, 10)
    assert result["prompt"] == QWEN3_PROMPTS["query"]
    assert result["plan"]["causal"] is True
    _check_cosines(result)
    assert result["target"]["ratio"] == "sentence_transformers.lane_ratio_vs_sentence_transformers"
    assert isinstance(result["target"]["met"], bool)

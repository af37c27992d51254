"""The Core ML lane end to end through `Module`: a real `python -m workers.ane` worker,
module-side tokenization, shapes compiled through the compile cache, the reference executor."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from certification.corpus import corpus
from certification.reference.bert import BertReference
from host.config import HostConfig
from host.module import Module, ModuleConfig
from ingest.model_packages import minilm_dir
from ingest.store import ArtifactStore
from service.metrics import Metrics
from workers.ane import apple_device
from workers.ane.config import ENV_COMPUTE_UNITS
from workers.protocol import messages as m

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MINILM_DIR = minilm_dir()


def module_config(store_root: str, runtime_dir: str) -> ModuleConfig:
    # Compiling a shape takes seconds; the default 600 s control window is what a user gets.
    return ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )


async def test_ane_lane_embeds_like_the_fp32_reference(store_root, short_runtime_dir):
    texts = list(corpus())[::9]  # 38 items of every kind, long ones included
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        # The reference executor on every OS (the coreml backend: the test below, on macOS).
        await mod.load("minilm-l6-v2", "ane", {"backend": "reference"})
        result = await mod.embed(texts, lane="ane")
        ids = (await mod.tokenizer(lane="ane")).encode(texts, truncate=True).ids
        share, source = await mod.placement("minilm-l6-v2", lane="ane")
        identity = mod.lane_identity("minilm-l6-v2", "ane")
        health = mod.health()["minilm-l6-v2@ane"]
    ref = BertReference.from_dir(MINILM_DIR).embed(ids, pooling="mean", normalize=True)
    cos = np.sum(result.vectors * ref, axis=1)
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, (float(cos.min()), float(cos.mean()))
    assert source == "estimate" and 0.0 < share <= 1.0  # the executor's static estimate
    assert identity["engine"] == "coreml-ane" and identity["kernel_revision"]
    assert identity["manifest_digest"] == identity["artifact_digest"]
    assert health.health.last_pong["placement_source"] == "estimate"


@pytest.mark.skipif(
    sys.platform != "darwin",
    reason="needs macOS: the coreml backend "
    "(compile_model, CompiledMLModel, MLComputePlan) does not exist on Linux",
)
async def test_the_coreml_backend_serves_and_reports_core_mls_placement(
    store_root, short_runtime_dir
):
    texts = list(corpus())[::19]
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load("minilm-l6-v2", "ane", {"backend": "coreml"})
        result = await mod.embed(texts, lane="ane")
        ids = (await mod.tokenizer(lane="ane")).encode(texts, truncate=True).ids
        share, source = await mod.placement("minilm-l6-v2", lane="ane")
    ref = BertReference.from_dir(MINILM_DIR).embed(ids, pooling="mean", normalize=True)
    assert np.sum(result.vectors * ref, axis=1).min() >= 0.999
    from workers.ane.coreml_backend import COMPUTE_PLAN_MIN_MACOS  # imports only on macOS

    if not apple_device.version_at_least(apple_device.macos_version(), COMPUTE_PLAN_MIN_MACOS):
        assert source == "estimate"  # macOS < 14.4 has no MLComputePlan
    else:
        assert source == "compute_plan" and 0.0 <= share <= 1.0
        if os.environ.get(ENV_COMPUTE_UNITS) == "cpu_only":  # hosted VMs: no Neural Engine
            assert share == 0.0


async def test_a_second_worker_reuses_compiled_shapes(store_root, short_runtime_dir):
    shapes = [{"rows": 2, "seq_len": 64}]
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load("minilm-l6-v2", lane="ane", runtime_config_extra={"shapes": shapes})
        lane = mod.supervisor("minilm-l6-v2", "ane")
        first_pid = lane.worker.pid
        admit = m.ADMIT_SHAPE(req_id=0, model_ref="minilm-l6-v2", rows=2, seq_len=64)
        reply, _ = await lane.request(admit)
        assert reply.shape_id == "2x64"
        await mod.unload("minilm-l6-v2", lane="ane")
        # A new worker process: the shape comes from the compile cache, nothing is compiled.
        await mod.load("minilm-l6-v2", lane="ane", runtime_config_extra={"shapes": []})
        lane = mod.supervisor("minilm-l6-v2", "ane")
        assert lane.worker.pid != first_pid
        reply, _ = await lane.request(admit)
        assert reply.cache_hit is True and reply.compile_ms == 0 and reply.build_ms == 0
        # /metrics reads the hit from the lane's cached PONG (this worker: 1 hit, 0 misses).
        await lane.ping()
        text = Metrics(lambda: mod, lambda: None).render().decode()
        assert _sample(text, "synapse_compile_cache_hits_total") == 1
        assert _sample(text, "synapse_compile_cache_misses_total") == 0
        assert _sample(text, "synapse_compile_cache_bytes") > 1_000_000
        evicted, _ = await lane.request(m.EVICT(req_id=0, model_ref="minilm-l6-v2"))
        assert evicted.shape_ids == ["2x64"] and evicted.freed_bytes > 0


async def test_a_core_ml_lane_allowed_on_the_gpu_holds_the_gpu_permit_too(
    store_root, short_runtime_dir, monkeypatch
):
    monkeypatch.delenv(ENV_COMPUTE_UNITS, raising=False)
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        await mod.load(
            "minilm-l6-v2",
            "ane",
            {
                "backend": "reference",
                "compute_units": "all",
                "shapes": [{"rows": 2, "seq_len": 32}],
            },
        )
        lane = mod.supervisor("minilm-l6-v2", "ane")
        assert lane.config.device == "ane+gpu"
        assert mod.lane_identity("minilm-l6-v2", "ane")["device"] == "ane+gpu"
        await mod.embed(["warm"], lane="ane")
        await mod.load("minilm-l6-v2", "llama")
        gpu = mod.permits.for_device("gpu")
        await gpu.acquire()  # the GPU is busy (an offloaded llama.cpp lane, say)
        embedding = asyncio.create_task(mod.embed(["waits for the GPU"], lane="ane"))
        for _ in range(3):  # time for the Core ML request many times over, on the cpu permit
            await mod.embed(["a CPU lane is not held up"], lane="llama")
        assert not embedding.done()
        gpu.release()
        assert (await asyncio.wait_for(embedding, 60)).vectors.shape == (1, 384)


def _sample(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


@pytest.fixture(scope="module")
def cross_encoder_store(store_root, test_cross_encoder_dir) -> Path:
    path = test_cross_encoder_dir
    store = ArtifactStore(store_root)
    if "test-xenc-ane" not in {r.name for r in store.ls()}:
        store.ingest_hf_dir(path, name="test-xenc-ane", dtype="f32")
    return path


async def test_ane_cross_encoder_uses_real_token_types(
    store_root, short_runtime_dir, cross_encoder_store
):
    query = "Where do cats like to sleep?"
    docs = list(corpus())[:40:2]
    async with Module(module_config(store_root, short_runtime_dir)) as mod:
        result = await mod.rerank(query, docs, model="test-xenc-ane", lane="ane")
        pairs = (await mod.tokenizer("test-xenc-ane", lane="ane")).encode_pairs(
            query, docs, truncate=True
        )
    assert result.method == "cross-encoder"
    ref = BertReference.from_dir(cross_encoder_store).score_many(pairs.ids, pairs.token_type_ids)
    got = np.array([dict(result.results)[i] for i in range(len(docs))])
    assert np.abs(got - ref).max() <= 5e-3


async def test_the_first_core_ml_build_runs_off_the_event_loop(tmp_path, short_runtime_dir):
    # A fresh store: no owned artifact yet, so this load builds one (the f32 weights, the
    # digest): the loop must keep running meanwhile, seen as a moment when the build's temp
    # dir exists and its manifest does not yet.
    store = ArtifactStore(tmp_path / "models")
    store.ingest_hf_dir(MINILM_DIR, name="mini", dtype="f16")
    owned = tmp_path / "owned"
    seen_building = False

    async with Module(module_config(str(store.root), short_runtime_dir)) as mod:
        load = asyncio.create_task(
            mod.load(
                "mini", "ane", {"backend": "reference", "shapes": [{"rows": 1, "seq_len": 16}]}
            )
        )
        while not load.done():
            temp = list(owned.glob(".mini-*.*")) if owned.is_dir() else []
            if any(p.is_dir() for p in temp) and not list(owned.glob("mini-*/manifest.json")):
                seen_building = True
            await asyncio.sleep(0.005)
        await load
        assert (await mod.embed(["a cat"], model="mini", lane="ane")).vectors.shape == (1, 384)
    assert seen_building, "the event loop did not run while the owned artifact was built"

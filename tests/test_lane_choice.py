"""Lane choice (`lane=None`): a certified Core ML lane for this machine, else llama.cpp.

Real lanes, a real certification run and real certificate files. The one thing Linux cannot
produce is a `certified` Core ML certificate: its placement gate passes only on Core ML's own
compute plan (macOS). So the certified case takes the REAL provisional certificate of this
run and records the placement a Mac's compute plan would add (`as_compute_plan_run`) — the
certificate's identity, quality checks and fingerprint stay the ones measured here.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile

import msgspec
import numpy as np
import pytest

from certification.certificate import Certificate
from certification.identity import os_name
from certification.lane_policy import CertificateLanePolicy, machine_differences
from certification.runner import RunOptions, certify
from certification.store import CertificateStore
from common.errors import InvalidRequest
from host.config import HostConfig
from host.lane_policy import NoLanePolicy
from host.module import Module, ModuleConfig

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MODEL = "minilm-l6-v2"
PACKED = [{"rows": 4, "seq_len": 256, "packed": True}]
TEXTS = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stocks fell."]


@contextlib.asynccontextmanager
async def module(store_root: str, policy=None):
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
    cfg = ModuleConfig(store_root=store_root,
                       host=HostConfig(runtime_dir=runtime, ping_interval_s=0))
    try:
        async with Module(cfg, policy) as mod:
            yield mod
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(autouse=True)
def _cache_env(synapse_cache_dir, monkeypatch):
    # Core ML workers compile into the session's compile cache, not $HOME.
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(synapse_cache_dir))


@pytest.fixture(scope="module")
def provisional(store_root, synapse_cache_dir, tmp_path_factory) -> Certificate:
    """A real certification of the Core ML lane on this machine, on the reference executor
    (provisional: its placement is the estimate on every OS)."""
    store = CertificateStore(tmp_path_factory.mktemp("certs-run"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYNAPSE_CACHE_DIR", str(synapse_cache_dir))

        async def go():
            async with module(store_root) as mod:
                return await certify(mod, RunOptions(
                    model=MODEL, lane="ane", shapes=PACKED, sample_stride=40,
                    runtime_config_extra={"backend": "reference"}), store)

        cert = asyncio.run(go())
    assert cert.status == "provisional" and cert.quality == "pass", cert.failing
    return cert


def as_compute_plan_run(cert: Certificate, **key_changes) -> Certificate:
    """The placement a Mac's MLComputePlan run records (the gate passes), optionally for
    another key; the id follows the key as in every certificate."""
    checks = [msgspec.structs.replace(c, status="pass", detail="source: compute_plan")
              if c.name == "placement.share" else c for c in cert.checks]
    key = msgspec.structs.replace(cert.key, **key_changes)
    measured = msgspec.structs.replace(cert.measurements, placement_source="compute_plan")
    return msgspec.structs.replace(cert, id=key.id, key=key, status="certified",
                                   placement="pass", checks=checks, measurements=measured)


def policy_with(tmp_path, *certs: Certificate) -> CertificateLanePolicy:
    store = CertificateStore(tmp_path / "certificates")
    for cert in certs:
        store.save(cert)
    return CertificateLanePolicy(store)


async def test_without_a_policy_llama_serves_and_says_why(store_root):
    async with module(store_root) as mod:
        assert isinstance(mod.lane_policy, NoLanePolicy)
        result = await mod.embed(TEXTS)
        choice = mod.lane_choices()[MODEL]
        assert choice.lane == "llama" and choice.device == "cpu"
        assert choice.reason == "llama/cpu: no certificate policy configured"
        assert mod.models() == [MODEL] and result.vectors.shape == (3, 384)
        with pytest.raises(InvalidRequest, match="lane 'gpu'"):
            await mod.embed(TEXTS, lane="gpu")


async def test_no_certificate_means_llama(store_root, tmp_path):
    async with module(store_root, policy_with(tmp_path)) as mod:
        assert mod.describe_lane(MODEL).reason == "llama/unknown device: no ANE certificate"
        await mod.rerank("cat", TEXTS)
        assert mod.lane_choices()[MODEL].reason == "llama/cpu: no ANE certificate"
        assert mod.describe_lane(MODEL) == mod.lane_choices()[MODEL]


async def test_a_provisional_certificate_keeps_llama(store_root, tmp_path, provisional):
    async with module(store_root, policy_with(tmp_path, provisional)) as mod:
        await mod.embed(TEXTS)
        choice = mod.lane_choices()[MODEL]
        assert choice.lane == "llama" and mod.models() == [MODEL]
        assert choice.reason == (f"llama/cpu: ANE certificate {provisional.id} is provisional "
                                 "(placement from an estimate, not Core ML's compute plan)")


async def test_a_certificate_for_this_machine_flips_to_ane(store_root, tmp_path, provisional):
    certified = as_compute_plan_run(provisional)
    assert certified.id == provisional.id and not machine_differences(certified.key)
    async with module(store_root, policy_with(tmp_path, certified)) as mod:
        chosen = await mod.embed(TEXTS)
        choice = mod.lane_choices()[MODEL]
        assert choice.lane == "ane" and choice.device == "ane"
        assert choice.reason == f"ane: certified {certified.created_at[:10]} (certificate " \
                                f"{certified.id})"
        assert mod.models() == [f"{MODEL}@ane"]  # served by the Core ML worker only
        identity = mod.lane_identity(MODEL)  # the chosen lane's, which the certificate keys
        assert identity["engine"] == "coreml-ane" and identity["device"] == "ane"
        ranked = await mod.rerank("a cat on a mat", TEXTS)
        assert ranked.method == "bi-encoder-cosine" and mod.models() == [f"{MODEL}@ane"]
        forced = await mod.embed(TEXTS, lane="llama")  # forcing still works beside it
        assert sorted(mod.models()) == [MODEL, f"{MODEL}@ane"]
        assert np.sum(chosen.vectors * forced.vectors, axis=1).min() >= 0.999
        await mod.unload(MODEL)  # the chosen lane; the next call chooses again
        assert mod.models() == [MODEL] and MODEL not in mod.lane_choices()


async def test_a_certificate_from_another_machine_does_not_flip(store_root, tmp_path,
                                                                provisional):
    mac = as_compute_plan_run(provisional, os="macOS-15.1-arm64")
    assert mac.id != provisional.id
    async with module(store_root, policy_with(tmp_path, mac)) as mod:
        await mod.embed(TEXTS)
        choice = mod.lane_choices()[MODEL]
        assert choice.lane == "llama" and mod.models() == [MODEL]  # no Core ML worker started
        assert choice.reason.startswith(
            f"llama/cpu: ANE certificate {mac.id} was issued on another machine "
            f"(os: macOS-15.1-arm64 here {os_name()}")


async def test_a_stale_identity_is_caught_once_loaded(store_root, tmp_path, provisional):
    """Same machine, but the kernel revision it certified is not the one running: the Core ML
    lane is loaded, its HELLO disagrees, it is unloaded and llama serves."""
    stale = as_compute_plan_run(provisional, kernel_revision="ane-bert-0")
    async with module(store_root, policy_with(tmp_path, stale)) as mod:
        await mod.embed(TEXTS)
        choice = mod.lane_choices()[MODEL]
        assert choice.lane == "llama" and mod.models() == [MODEL]
        assert choice.reason.startswith(
            f"llama/cpu: ANE certificate {stale.id} does not cover the loaded lane: ")
        assert f"kernel_revision: ane-bert-0 -> {provisional.key.kernel_revision}" in choice.reason


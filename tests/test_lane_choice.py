"""Lane choice (`lane=None`): a certified Core ML lane for this machine, else llama.cpp.

Real lanes, a real certification run and real certificate files. The one thing Linux cannot
produce is a `certified` Core ML certificate: its placement gate passes only on Core ML's own
compute plan (macOS). So the certified case takes the REAL provisional certificate of this
run and records the placement a Mac's compute plan would add (`as_compute_plan_run`) — the
certificate's identity, quality checks and fingerprint stay the ones measured here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import msgspec
import numpy as np
import pytest

from batch.job import JobOptions, run_job
from batch.output import read_metadata
from certification.certificate import Certificate
from certification.identity import os_name
from certification.lane_policy import CertificateLanePolicy, machine_differences
from certification.modules import build_module
from certification.store import CertificateStore
from cli.main import main as cli_main
from common.errors import InvalidRequest
from host.config import HostConfig
from host.lane_policy import NoLanePolicy
from host.module import Module, ModuleConfig
from tests.batch_support import write_jsonl
from tests.test_serve_support import ServerProcess, server_config

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MODEL = "minilm-l6-v2"
TEXTS = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stocks fell."]


@contextlib.asynccontextmanager
async def module(store_root: str, policy=None):
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
    cfg = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0)
    )
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
def provisional(minilm_ane_certificate) -> Certificate:
    """A real certification of the Core ML lane on this machine, on the reference executor
    (provisional: its placement is the estimate on every OS): the session's one run of it
    (tests/conftest.py: the packed 4x256 shape, every 8th corpus item)."""
    cert = minilm_ane_certificate
    assert (cert.key.model, cert.key.lane, cert.key.shapes) == (MODEL, "ane", ("4x256p/16",))
    assert cert.status == "provisional" and cert.quality == "pass", cert.failing
    return cert


def as_compute_plan_run(cert: Certificate, **key_changes) -> Certificate:
    """The placement a Mac's MLComputePlan run records (the gate passes), optionally for
    another key; the id follows the key as in every certificate."""
    checks = [
        msgspec.structs.replace(c, status="pass", detail="source: compute_plan")
        if c.name == "placement.share"
        else c
        for c in cert.checks
    ]
    key = msgspec.structs.replace(cert.key, **key_changes)
    measured = msgspec.structs.replace(cert.measurements, placement_source="compute_plan")
    return msgspec.structs.replace(
        cert,
        id=key.id,
        key=key,
        status="certified",
        placement="pass",
        checks=checks,
        measurements=measured,
    )


def served(mod) -> list[tuple[str, str]]:
    return [(lane.model, lane.lane) for lane in mod.served_lanes()]


def policy_with(tmp_path, *certs: Certificate) -> CertificateLanePolicy:
    store = CertificateStore(tmp_path / "certificates")
    for cert in certs:
        store.save(cert)
    return CertificateLanePolicy(store)


async def test_without_a_policy_llama_serves_and_says_why(store_root):
    async with module(store_root) as mod:
        assert isinstance(mod.lane_policy, NoLanePolicy)
        result = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lane == "llama" and choice.device == "cpu"
        assert choice.reason == "llama/cpu: no certificate policy configured"
        assert served(mod) == [(MODEL, "llama")] and result.vectors.shape == (3, 384)
        with pytest.raises(InvalidRequest, match="lane 'gpu'"):
            await mod.embed(TEXTS, lane="gpu")


async def test_no_certificate_means_llama(store_root, tmp_path):
    async with module(store_root, policy_with(tmp_path)) as mod:
        assert mod.default_lane(MODEL).reason == "llama/unknown device: no ANE certificate"
        await mod.rerank("cat", TEXTS)
        assert mod.chosen_lanes()[MODEL].reason == "llama/cpu: no ANE certificate"
        assert mod.default_lane(MODEL) == mod.chosen_lanes()[MODEL]


async def test_a_provisional_certificate_keeps_llama(store_root, tmp_path, provisional):
    async with module(store_root, policy_with(tmp_path, provisional)) as mod:
        await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lane == "llama" and served(mod) == [(MODEL, "llama")]
        assert choice.reason == (
            f"llama/cpu: ANE certificate {provisional.id} is provisional "
            "(placement from an estimate, not Core ML's compute plan)"
        )


async def test_a_certificate_for_this_machine_flips_to_ane(store_root, tmp_path, provisional):
    certified = as_compute_plan_run(provisional)
    assert certified.id == provisional.id and not machine_differences(certified.key)
    async with module(store_root, policy_with(tmp_path, certified)) as mod:
        chosen = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lane == "ane" and choice.device == "ane"
        assert (
            choice.reason == f"ane: certified {certified.created_at[:10]} (certificate "
            f"{certified.id})"
        )
        assert served(mod) == [(MODEL, "ane")]  # served by the Core ML worker only
        identity = mod.lane_identity(MODEL)  # the chosen lane's, which the certificate keys
        assert identity["engine"] == "coreml-ane" and identity["device"] == "ane"
        ranked = await mod.rerank("a cat on a mat", TEXTS)
        assert ranked.method == "bi-encoder-cosine" and served(mod) == [(MODEL, "ane")]
        forced = await mod.embed(TEXTS, lane="llama")  # forcing still works beside it
        assert served(mod) == [(MODEL, "ane"), (MODEL, "llama")]
        assert np.sum(chosen.vectors * forced.vectors, axis=1).min() >= 0.999
        await mod.unload(MODEL)  # the chosen lane; the next call chooses again
        assert served(mod) == [(MODEL, "llama")] and MODEL not in mod.chosen_lanes()


async def test_a_certificate_from_another_machine_does_not_flip(store_root, tmp_path, provisional):
    mac = as_compute_plan_run(provisional, os="macOS-15.1-arm64")
    assert mac.id != provisional.id
    async with module(store_root, policy_with(tmp_path, mac)) as mod:
        await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        # No Core ML worker started.
        assert choice.lane == "llama" and served(mod) == [(MODEL, "llama")]
        assert choice.reason.startswith(
            f"llama/cpu: ANE certificate {mac.id} was issued on another machine "
            f"(os: macOS-15.1-arm64 here {os_name()}"
        )


async def test_a_stale_identity_is_caught_once_loaded(store_root, tmp_path, provisional):
    """Same machine, but the kernel revision it certified is not the one running: the Core ML
    lane is loaded, its HELLO disagrees, it is unloaded and llama serves."""
    stale = as_compute_plan_run(provisional, kernel_revision="ane-bert-0")
    async with module(store_root, policy_with(tmp_path, stale)) as mod:
        await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lane == "llama" and served(mod) == [(MODEL, "llama")]
        assert choice.reason.startswith(
            f"llama/cpu: ANE certificate {stale.id} does not cover the loaded lane: "
        )
        assert f"kernel_revision: ane-bert-0 -> {provisional.key.kernel_revision}" in choice.reason


# ---- every entry point builds its Module with the certificate policy ----------------------
#
# One certified certificate for this machine is written where a Module of a private cache
# dir looks for certificates (its models are the session's, linked). Each entry point is then
# run as a user runs it; each must serve, or say it would serve, the Core ML lane.


@pytest.fixture(scope="module")
def certified_cache(synapse_cache_dir, provisional, tmp_path_factory):
    """A cache dir whose models and compile cache are the session's and whose certificates
    hold one certificate `certified` for this machine: (dir, certificate)."""
    cache = tmp_path_factory.mktemp("certified-cache")
    for entry in synapse_cache_dir.iterdir():
        if entry.name != "certificates":
            (cache / entry.name).symlink_to(entry)
    certified = as_compute_plan_run(provisional)
    CertificateStore(cache / "certificates").save(certified)
    yield cache, certified
    shutil.rmtree(cache, ignore_errors=True)


def test_build_module_reads_the_certificates_beside_its_store(certified_cache, tmp_path):
    cache, cert = certified_cache
    mod = build_module(ModuleConfig(store_root=str(cache / "models")))
    assert mod.default_lane(MODEL).lane == "ane"
    assert mod.default_lane(MODEL).reason.endswith(f"(certificate {cert.id})")
    # The same models with no certificates beside them: llama.cpp, and why.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "models").symlink_to(cache / "models")
    other = build_module(ModuleConfig(store_root=str(bare / "models")))
    assert other.default_lane(MODEL).reason == "llama/unknown device: no ANE certificate"


def test_the_cli_serves_the_certified_lane(certified_cache, monkeypatch, capsys):
    cache, cert = certified_cache
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(cache))
    assert cli_main(["embed", "--json", "a cat on a mat"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lane"] == "ane" and len(out["data"][0]) == 384  # served by the Core ML worker
    assert cli_main(["doctor", "--json"]) == 0
    lanes = json.loads(capsys.readouterr().out)["lanes"]
    assert lanes[MODEL]["lane"] == "ane" and cert.id in lanes[MODEL]["reason"]


def test_python_m_service_serves_the_certified_lane(certified_cache):
    cache, cert = certified_cache
    server = ServerProcess(server_config(str(cache / "models")))
    try:
        reply = httpx.post(
            f"{server.url}/v1/embeddings", json={"model": MODEL, "input": TEXTS}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        assert set(server.health()["lanes"]) == {f"{MODEL}@ane"}  # the Core ML worker only
        models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert models[MODEL]["lane"] == "ane" and cert.id in models[MODEL]["lane_reason"]
    finally:
        server.stop()


async def test_the_bulk_job_serves_the_certified_lane(certified_cache, short_runtime_dir, tmp_path):
    cache, cert = certified_cache
    write_jsonl(tmp_path / "in.jsonl", 5)
    config = ModuleConfig(
        store_root=str(cache / "models"),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    summary = await run_job(
        JobOptions(
            input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out.parquet"), module=config
        )
    )
    assert summary.rows == 5 and summary.errors == 0
    meta = read_metadata(tmp_path / "out.parquet")
    assert meta["lane"] == "ane", meta


def test_the_ray_data_actor_serves_the_certified_lane(certified_cache, short_runtime_dir):
    from batch.ray_job import EmbedActor  # the actor class itself: its own __init__ builds

    cache, cert = certified_cache
    config = ModuleConfig(
        store_root=str(cache / "models"),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
    )
    actor = EmbedActor(MODEL, None, True, True, msgspec.json.encode(config), 1)
    try:
        assert actor.embedder.lane == "ane"
        assert json.loads(actor.meta)["lane"] == "ane"
    finally:
        actor.close()


def test_the_ray_serve_replica_serves_the_certified_lane(certified_cache, ray_session, tmp_path):
    """`synapse serve --ray`, one replica: its /v1/models says the certified lane serves."""
    cache, cert = certified_cache
    runtime_dir = tempfile.mkdtemp(prefix="syns-", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "serve.toml"
    config.write_text(
        f"port = {port}\ninstall_defaults = false\n"
        f'[module]\nstore_root = "{cache / "models"}"\n'
        f'[module.host]\nruntime_dir = "{runtime_dir}"\n'
        f"[ray]\nnum_replicas = 1\nreplica_cpus = 0.5\n"
    )
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--ray", address, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("synapse serve: listening on"):
                break
        else:
            raise AssertionError(f"serve --ray exited {proc.wait()} before listening")
        reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60)
        models = {m["id"]: m for m in reply.json()["data"]}
        assert models[MODEL]["lane"] == "ane" and cert.id in models[MODEL]["lane_reason"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert proc.returncode == 0

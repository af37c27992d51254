"""One model served by two lanes, end to end on real workers: the reference executor as the
Core ML lane and the CPU llama.cpp lane as the second.

Certification records each lane's latency curve and, certifying the second lane, its
agreement with the first; a Module then serves the model on both lanes and routes each call
by size; lanes that disagree, or of which one cannot start, are not routed (and say why), and
the better certified lane serves alone; an explicit lane list serves without certificates once
the agreement measured at load passes; the HTTP answer names its
lane; a bulk job runs both lanes at once and records both.

The certified Core ML certificate is the REAL provisional one of this run with the placement a
Mac's compute plan would add (as tests/test_lane_choice.py does: Linux has no compute plan).
Only the routing test replaces the measured curves, and the fallback tests the measured
distance from the reference, with values whose answer is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile

import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from batch.job import JobOptions, run_job
from batch.output import read_metadata
from certification.certificate import Certificate
from certification.lane_policy import CertificateLanePolicy
from certification.runner import RunOptions, certify
from certification.store import CertificateStore
from host.config import HostConfig
from host.lane_router import CURVE_ITEMS, Ask, LatencyCurve, refusal
from host.module import Module, ModuleConfig
from service.app import create_app
from service.config import ServeConfig
from tests.batch_support import texts, write_jsonl
from tests.session_certs import adopt
from tests.test_lane_choice import as_compute_plan_run
from tests.test_serve_support import metric

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

MODEL = "minilm-l6-v2"
STRIDE = 40  # every 40th corpus item: 9 items, enough to prove the rule, cheap on 2 cores
TEXTS = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stocks fell."]


@contextlib.asynccontextmanager
async def module(store_root: str, policy, **config):
    runtime = tempfile.mkdtemp(prefix="syn-", dir="/tmp")  # short: socket paths
    cfg = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime, ping_interval_s=0), **config
    )
    try:
        async with Module(cfg, policy) as mod:
            yield mod
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(autouse=True)
def _cache_env(own_certificates_cache, monkeypatch):
    # Core ML workers compile into the session's compile cache, not $HOME.
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(own_certificates_cache))


@pytest.fixture(scope="module")
def certs(own_certificates_cache, minilm_ane_certificate) -> tuple[Certificate, Certificate]:
    """Real certifications on this machine, Core ML lane first (the session's one run of it,
    tests/conftest.py, saved here as its run would have saved it), then llama.cpp (which finds
    the first and records the agreement); the Core ML one then as a Mac would certify it.
    Saved where a Module built on `own_certificates_cache` reads them."""
    store = CertificateStore(own_certificates_cache / "certificates")
    models = str(own_certificates_cache / "models")
    ane = minilm_ane_certificate
    assert (ane.key.model, ane.key.lane, ane.quality) == (MODEL, "ane", "pass")
    adopt(ane, store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYNAPSE_CACHE_DIR", str(own_certificates_cache))

        async def run(lane: str, **options) -> Certificate:
            async with module(models, None) as mod:
                return await certify(
                    mod,
                    RunOptions(
                        model=MODEL, lane=lane, sample_stride=STRIDE, token_outputs=False, **options
                    ),
                    store,
                )

        llama = asyncio.run(run("llama"))
    certified = as_compute_plan_run(ane)
    store.save(certified)
    assert llama.status == "certified", llama.failing
    return certified, llama


def policy_with(tmp_path, *certs: Certificate, stride: int = STRIDE) -> CertificateLanePolicy:
    store = CertificateStore(tmp_path / "certificates")
    for cert in certs:
        store.save(cert)
    return CertificateLanePolicy(store, agreement_stride=stride)


def with_curve(cert: Certificate, seconds: list[float]) -> Certificate:
    curve = LatencyCurve(items=list(CURVE_ITEMS), seconds=seconds, tokens=12)
    measured = msgspec.structs.replace(cert.measurements, latency_curve=curve)
    return msgspec.structs.replace(cert, measurements=measured)


def with_min_cosine(cert: Certificate, value: float) -> Certificate:
    """`cert` as if its worst corpus item had measured `value` against the reference."""
    checks = [
        msgspec.structs.replace(c, value=value) if c.name == "quality.min_cosine" else c
        for c in cert.checks
    ]
    return msgspec.structs.replace(cert, checks=checks)


def disagreeing(llama: Certificate) -> Certificate:
    assert llama.agreement is not None
    return msgspec.structs.replace(
        llama, agreement=msgspec.structs.replace(llama.agreement, min_cosine=0.9990)
    )


def test_certification_records_the_curve_and_the_agreement(certs):
    ane, llama = certs
    for cert in certs:
        curve = cert.measurements.latency_curve
        assert curve is not None and curve.items == [1, 4, 16, 64] and curve.tokens > 0
        assert all(s > 0 for s in curve.seconds) and curve.seconds[3] > curve.seconds[0]
    assert ane.agreement is None  # the first lane had no certified peer to compare with
    agreement = llama.agreement
    assert agreement is not None and agreement.source == "certification"
    assert agreement.lanes == ["llama", "ane"] and agreement.n_items == 9
    assert agreement.certificates == [llama.id, ane.id]
    assert agreement.min_cosine is not None and agreement.passed, agreement.describe()


async def test_two_certified_lanes_serve_together_routed_by_size(
    store_root, tmp_path, certs, monkeypatch
):
    ane, llama = certs
    # The Neural Engine's shape of curve (quick alone) and the GPU's (cheap in bulk).
    fast_alone = with_curve(ane, [0.002, 0.008, 0.032, 0.128])
    fast_bulk = with_curve(llama, [0.010, 0.011, 0.014, 0.030])
    async with module(store_root, policy_with(tmp_path, fast_alone, fast_bulk)) as mod:
        assert mod.default_lane(MODEL).lanes == ("ane", "llama")  # before any worker starts
        one = await mod.embed(TEXTS[:1])
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lanes == ("ane", "llama") and choice.lane == "ane"
        assert choice.reason.startswith("routed ane+llama: vectors agree (min cos ")
        assert choice.reason.endswith(f"certificates {ane.id}, {llama.id}")
        many = await mod.embed(TEXTS * 22)  # 66 items
        assert (one.lane, many.lane) == ("ane", "llama")
        assert mod.serving_lanes(MODEL) == ("ane", "llama")
        # While 64 items keep the GPU lane busy, a single query still goes to the ANE and
        # 16 more items go where they finish first: after the GPU's backlog (0.03 + 0.014)
        # rather than on the ANE (0.032).
        busy = asyncio.create_task(mod.embed(TEXTS * 22))
        while not busy.done() and mod.pick_lane(MODEL, 16) == "llama":
            await asyncio.sleep(0)  # until its items are in flight on the llama lane
        assert not busy.done() and mod.pick_lane(MODEL, 1) == "ane"
        assert (await busy).lane == "llama"
        assert mod.pick_lane(MODEL, 16) == "llama"  # the backlog is gone
        ranked = await mod.rerank("a cat on a mat", TEXTS)  # 3 documents: the ANE
        assert ranked.lane == "ane"
        # Token-level outputs on a Core ML lane certified with packed shapes only: its packed
        # graphs give them, so its worker declares nothing refused and the size rule sends one
        # input there. (A lane that refuses an output is passed over: test_multivector_heads.)
        assert refusal(mod.refusals(MODEL, "ane"), Ask(("tokens",))) is None
        served = await mod.encode_outputs(TEXTS[:1], ["tokens"], MODEL, lane="ane")
        assert served.lane == "ane"
        serving = "ane"
        states = await mod.encode_outputs(TEXTS[:1], ["tokens"], MODEL)
        late = await mod.late_chunk(["The cat sits ", "on the mat."], MODEL)
        assert (states.lane, late.lane) == (serving, serving)
        assert mod.refusals(MODEL, "llama") == ()
        # An input longer than a lane's longest shape goes to the other lane, whatever the
        # size rule says. This Core ML lane's shape holds the model's whole limit (its worker
        # declared 256); a lane admitted with shorter shapes is stood for by what its worker
        # would declare, the one thing the router reads of it (the declaration itself:
        # test_ane_engine).
        assert mod.max_item_tokens(MODEL, "ane") == 256
        assert mod.max_item_tokens(MODEL, "llama") is None  # the model's own limit
        monkeypatch.setattr(mod, "max_item_tokens", lambda n, lane: 16 if lane == "ane" else None)
        assert mod.pick_lane(MODEL, 1, longest=16) == "ane"
        assert mod.pick_lane(MODEL, 1, longest=17) == "llama"
        long_query = "a cat sits on the old red mat near the river bank while markets fell"
        short, long = await mod.embed(["a cat"]), await mod.embed([long_query])
        assert long.usage.prompt_tokens > 16 >= short.usage.prompt_tokens
        assert (short.lane, long.lane) == ("ane", "llama")  # routed again once tokenized
    cos = np.sum(one.vectors[0] * many.vectors[0])
    assert cos >= 0.9998  # one text, two lanes: the same vector


async def test_lanes_that_disagree_are_not_routed(store_root, tmp_path, certs):
    ane, llama = certs
    # llama.cpp certified the farther from the reference: the Core ML lane serves alone (the
    # next test turns it around).
    farther = with_min_cosine(disagreeing(llama), 0.99995)
    async with module(store_root, policy_with(tmp_path, ane, farther)) as mod:
        said = mod.default_lane(MODEL)  # what doctor and /v1/models show
        why = "not routed: lanes ane+llama disagree (min cos 0.999000 < 0.9998 on 9 items"
        assert said.lanes == () and why in said.reason
        result = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert result.lane == "ane" and choice.lanes == () and why in choice.reason
        assert [s.lane for s in mod.served_lanes()] == ["ane"]  # no second worker


async def test_of_lanes_that_disagree_the_one_certified_closer_to_the_reference_serves(
    store_root, tmp_path, certs
):
    """The Core ML lane is a certified candidate too, but its certificate measured it farther
    from the reference than llama.cpp's: llama.cpp serves, whatever the single-lane rule
    (which prefers a certified Core ML lane) would say."""
    ane, llama = certs
    llama_fit = next(c.value for c in llama.checks if c.name == "quality.min_cosine")
    assert llama_fit is not None and llama_fit > 0.99995
    farther = with_min_cosine(ane, 0.99995)
    async with module(store_root, policy_with(tmp_path, farther, disagreeing(llama))) as mod:
        fits = mod.lane_policy.lane_set(MODEL, None).fits
        assert fits["llama"].error == pytest.approx(1 - llama_fit)  # the real certificate's
        assert fits["ane"].error == pytest.approx(5e-5)
        said = mod.default_lane(MODEL)  # what doctor and /v1/models show, no worker started
        assert said.lane == "llama" and said.lanes == ()
        assert "the better certified of ane+llama against the reference (llama: " in said.reason
        assert "not routed: lanes ane+llama disagree (min cos 0.999000" in said.reason
        result = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert result.lane == "llama" and choice.lane == "llama" and choice.lanes == ()
        assert choice.reason.startswith("llama/cpu: the better certified of ane+llama")
        assert f"1 - min cos 5.00e-05, certificate {ane.id}" in choice.reason
        assert [s.lane for s in mod.served_lanes()] == ["llama"]  # no Core ML worker


async def test_a_lane_that_cannot_start_is_passed_over_for_the_next_certified_one(
    store_root, tmp_path, certs
):
    """Both lanes certified and agreeing, the Core ML lane the closer to the reference, but
    its worker dies before it connects: it is passed over, and the llama.cpp lane serves alone
    as the next certified one (not by the single-lane rule's "its lane failed to load")."""
    ane, llama = certs
    farther = with_min_cosine(llama, 0.99995)
    crashing = ["python", "-m", "workers.faulty", "--fault", "crash_on_start"]
    argv = {"llama": ["python", "-m", "workers.llama"], "ane": crashing}
    async with module(store_root, policy_with(tmp_path, ane, farther), worker_argv=argv) as mod:
        assert mod.default_lane(MODEL).lanes == ("ane", "llama")  # they agree: routed
        result = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert result.lane == "llama" and choice.lanes == ()
        assert choice.reason.startswith("llama/cpu: the better certified of ane+llama")
        assert "(ane: 1 - min cos" in choice.reason  # the closer one, passed over
        assert "not routed: lanes ane+llama could not be loaded together" in choice.reason
        assert "exited before connecting" in choice.reason
        assert [s.lane for s in mod.served_lanes()] == ["llama"]


async def test_listed_lanes_serve_without_a_certificate_once_they_agree_at_load(
    store_root, tmp_path, certs
):
    """`lanes = ["ane", "llama"]` with the llama.cpp lane never certified: both serve once the
    agreement measured at load passes, and the uncertified lane's curve is measured there.
    (The Core ML lane keeps its certificate so that it loads the certified shapes: on the
    reference executor its default shapes take minutes to time.)"""
    ane, _ = certs
    lanes = {MODEL: ["ane", "llama"]}
    async with module(store_root, policy_with(tmp_path, ane), model_lanes=lanes) as mod:
        said = mod.default_lane(MODEL)
        assert said.lanes == ("ane", "llama") and "measured at load" in said.reason
        result = await mod.embed(TEXTS)
        choice = mod.chosen_lanes()[MODEL]
        assert choice.lanes == ("ane", "llama"), choice.reason
        assert "on 9 items, measured at load" in choice.reason
        assert choice.reason.endswith(f"certificates {ane.id}")  # llama has none
        curves = mod.latency_curves(MODEL)
        assert curves["ane"] == ane.measurements.latency_curve  # the certificate's
        assert curves["llama"].items == [1, 4, 16, 64] and min(curves["llama"].seconds) > 0
        assert result.lane == mod.pick_lane(MODEL, len(TEXTS))
        await mod.unload(MODEL, "llama")  # a pair without one lane chooses again
        assert mod.serving_lanes(MODEL) == ()


def test_the_http_answer_names_its_lane_and_metrics_count_it(own_certificates_cache, certs):
    config = ServeConfig(
        install_defaults=False,
        preload=[],
        module=ModuleConfig(
            store_root=str(own_certificates_cache / "models"),
            host=HostConfig(runtime_dir=tempfile.mkdtemp(prefix="syn-", dir="/tmp")),
        ),
    )
    with TestClient(create_app(config)) as client:
        reply = client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[0]})
        assert reply.status_code == 200, reply.text
        lane = reply.headers["x-synapse-lane"]
        assert lane in ("ane", "llama") and reply.json()["usage"]["lane"] == lane
        ranked = client.post(
            "/v1/rerank", json={"model": MODEL, "query": "cat", "documents": TEXTS}
        )
        assert ranked.json()["usage"]["lane"] == ranked.headers["x-synapse-lane"]
        states = client.post("/embed_all", json={"model": MODEL, "inputs": TEXTS[1]})
        assert states.status_code == 200, states.text
        token_lane = states.headers["x-synapse-lane"]  # a lane that serves token states
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert models[MODEL]["lane_reason"].startswith("routed ane+llama: vectors agree")
        text = client.get("/metrics").text
        assert metric(text, "synapse_lane_requests_total", model=MODEL, lane=lane) >= 1
        assert metric(text, "synapse_lane_items_total", model=MODEL, lane=lane) >= 1
        assert metric(text, "synapse_lane_requests_total", model=MODEL, lane=token_lane) >= 1
    shutil.rmtree(config.module.host.runtime_dir, ignore_errors=True)


async def test_a_bulk_job_runs_both_lanes_and_records_both(
    own_certificates_cache, certs, short_runtime_dir, tmp_path
):
    ane, llama = certs
    write_jsonl(tmp_path / "in.jsonl", 48)
    config = ModuleConfig(
        store_root=str(own_certificates_cache / "models"),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0),
        max_batch_items=4,  # 12 batches: both lanes take some
    )
    summary = await run_job(
        JobOptions(
            input=str(tmp_path / "in.jsonl"),
            output=str(tmp_path / "out.parquet"),
            module=config,
            lane="ane,llama",
            workers=1,
        )
    )
    assert summary.rows == 48 and summary.errors == 0
    assert set(summary.lane_rows) == {"ane", "llama"} and sum(summary.lane_rows.values()) == 48
    meta = read_metadata(tmp_path / "out.parquet")
    assert meta["lane"] == "ane,llama"
    assert meta["certificate"] == f"{ane.id} (certified),{llama.id} (certified)"
    vectors = np.stack(pq.read_table(tmp_path / "out.parquet")["embedding"].to_numpy(False))
    async with module(str(own_certificates_cache / "models"), None) as mod:
        alone = await mod.embed(texts(48), lane="llama")
    assert np.sum(vectors * alone.vectors, axis=1).min() >= 0.9998  # either lane: one vector
    # Token states in bulk: only the lanes that serve them take windows (both do here), so no
    # window is refused.
    tokens = await run_job(
        JobOptions(
            input=str(tmp_path / "in.jsonl"),
            output=str(tmp_path / "tokens.parquet"),
            module=config,
            lane="ane,llama",
            workers=1,
            outputs=("tokens",),
        )
    )
    assert tokens.rows == 48 and tokens.errors == 0
    used = read_metadata(tmp_path / "tokens.parquet")["lane"].split(",")
    assert set(tokens.lane_rows) == set(used) and sum(tokens.lane_rows.values()) == 48

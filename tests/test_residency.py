"""host/residency.py: the keep-alive and budget settings, and the policy through a real `Module`
(real llama.cpp workers, their real RSS): a busy model is never evicted, an unload drains,
a measured size over the budget is refused, and the machine check. A model's bytes count once
while its first PING runs: through a real Module over the fault-injection worker (no model
built), whose first PING the worker holds by stopping itself."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from host.config import HostConfig
from host.errors import ConfigInvalid, InsufficientMemory
from host.module import Module, ModuleConfig
from host.residency import (
    DEFAULT_OVERHEAD_MB,
    ResidencyConfig,
    machine_available_mb,
    parse_keep_alive,
)
from ingest.model_packages import minilm_dir
from ingest.store import MANIFEST_FILE, Manifest
from service.config import ServeConfig, load_config
from tests.faulty_support import WORKER, thaw

F16, F32 = "minilm-l6-v2-f16", "minilm-l6-v2-f32"
LONG_INPUT = [f"sentence {i} " + "lorem ipsum dolor sit amet " * 60 for i in range(16)]


# ---- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [
    (None, math.inf), (-1, math.inf), ("forever", math.inf), ("never", math.inf),
    ("-1", math.inf), (0, 0.0), ("0", 0.0), (30, 30.0), (2.5, 2.5), ("30", 30.0),
    ("500ms", 0.5), ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("1d", 86400.0),
    (" 5M ", 300.0),
])  # fmt: skip
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m5", "5x", "1h 30m", "nan", True])
def test_a_bad_duration_is_a_config_error(value):
    with pytest.raises(ConfigInvalid, match="keep_alive"):
        parse_keep_alive(value)


@pytest.mark.parametrize("bad", [
    {"max_resident_mb": 0}, {"max_resident_mb": -5}, {"max_resident_mb": float("nan")},
    {"load_overhead_mb": 0}, {"min_free_mb": -1}, {"keep_alive": "soon"},
    {"models": {"m": {"keep_alive": "soon"}}}, {"models": {"m": {"keep_alive_s": 1}}},
])  # fmt: skip
def test_invalid_residency_settings_are_refused(bad):
    with pytest.raises((ConfigInvalid, msgspec.ValidationError)):
        msgspec.convert({"residency": bad}, ServeConfig)


def test_the_toml_config_per_model_and_global(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        '[aliases]\n"text-embedding-3-small" = "minilm-l6-v2"\n'
        '[residency]\nkeep_alive = "5m"\nmax_resident_mb = 2048\n'
        '[residency.models."text-embedding-3-small"]\nkeep_alive = "forever"\n'
        "[residency.models.gemma3-270m]\nkeep_alive = 30\n"
    )
    res = load_config(path).residency
    assert res.max_resident_mb == 2048
    # Per-model settings named by alias apply to the model it names.
    assert set(res.models) == {"minilm-l6-v2", "gemma3-270m"}
    assert res.keep_alive_s("minilm-l6-v2") == math.inf
    assert res.keep_alive_s("gemma3-270m") == 30.0
    assert res.keep_alive_s("anything-else") == 300.0
    assert ServeConfig().residency.keep_alive_s("x") == math.inf  # default: models stay


def test_the_machine_says_what_is_available():
    available = machine_available_mb()
    assert available is not None and available > 0
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    assert available <= int(meminfo["MemTotal"].split()[0]) / 1024


# ---- the policy through a real Module ------------------------------------------------------


def _module(store_root: str, runtime_dir: str, **residency) -> Module:
    cfg = ModuleConfig(
        store_root=store_root, host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )
    return Module(cfg, residency=msgspec.convert(residency, ResidencyConfig))


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.mark.model
async def test_a_never_loaded_model_is_estimated_from_its_manifest(store_root, short_runtime_dir):
    async with _module(store_root, short_runtime_dir) as mod:
        record = mod.store.get(F16)
        mb, source = mod.residency.estimate(F16, "llama", record)
        assert source == "estimate"
        assert mb == record.manifest.size_bytes / 2**20 + DEFAULT_OVERHEAD_MB["embed"]
        await mod.embed(["measure me"], model=F16)
        rss = mod.residency.resident_mb(F16)
        assert rss is not None and rss > record.manifest.size_bytes / 2**20
        assert mod.residency.estimate(F16, "llama", record) == (rss, "measured")
        await mod.residency.unload(F16)
        assert mod.residency.estimate(F16, "llama", record) == (rss, "measured")  # kept


@pytest.mark.model
async def test_a_busy_model_is_never_evicted(store_root, short_runtime_dir):
    # One MiniLM (~155-175 MB) fits in 250 MB, two do not.
    async with _module(store_root, short_runtime_dir, max_resident_mb=250) as mod:
        await mod.embed(["first"], model=F32)
        pid = mod.supervisor(F32, "llama").worker.pid
        long = asyncio.create_task(mod.embed(LONG_INPUT, model=F32))
        await _until(
            lambda: mod.residency.describe(F32, "llama", mod.store.get(F32))["in_flight"] == 1
        )
        with pytest.raises(InsufficientMemory, match=f"held by models in use.*{F32}") as exc:
            await mod.embed(["second"], model=F16)
        assert exc.value.details["budget_mb"] == 250
        assert F16 not in mod.residents()  # refused before its worker started
        result = await long
        assert result.vectors.shape[0] == len(LONG_INPUT)
        assert mod.supervisor(F32, "llama").worker.pid == pid  # it ran to the end on its own worker
        # Idle now: the same load makes room by unloading it.
        await mod.embed(["second"], model=F16)
        assert set(mod.residents()) == {F16}
        assert mod.residency.unloads == {"budget": 1}


@pytest.mark.model
async def test_unload_drains_calls_inside_and_holds_new_ones(store_root, short_runtime_dir):
    async with _module(store_root, short_runtime_dir) as mod:
        await mod.embed(["warm"], model=F32)
        old_pid = mod.supervisor(F32, "llama").worker.pid
        long = asyncio.create_task(mod.embed(LONG_INPUT, model=F32))
        await _until(
            lambda: mod.residency.describe(F32, "llama", mod.store.get(F32))["in_flight"] == 1
        )
        unload = asyncio.create_task(mod.residency.unload(F32))
        await _until(lambda: mod.residency.is_unloading(F32))
        late = asyncio.create_task(mod.embed(["late"], model=F32))  # waits at the gate
        assert await unload is True
        assert long.done() and long.result().vectors.shape[0] == len(LONG_INPUT)
        assert not late.done() or F32 in mod.residents()
        result = await late  # went on after the unload: the model loaded again
        assert result.vectors.shape[0] == 1
        assert mod.supervisor(F32, "llama").worker.pid != old_pid
        assert mod.residency.unloads == {"request": 1}
        assert await mod.residency.unload(F16) is False  # not loaded: nothing to do


@pytest.mark.model
async def test_a_measured_size_over_the_budget_is_refused(store_root, short_runtime_dir):
    # The estimate (file + 1 MB) fits in 120 MB; the worker's real RSS (~150 MB) does not.
    async with _module(
        store_root, short_runtime_dir, max_resident_mb=120, load_overhead_mb=1
    ) as mod:
        with pytest.raises(InsufficientMemory, match="measured .* once loaded") as exc:
            await mod.embed(["x"], model=F32)
        measured = exc.value.details["needed_mb"]
        assert measured > 120
        assert mod.residents() == {}  # unloaded again
        # Next time the measured size refuses it before a worker starts.
        with pytest.raises(InsufficientMemory, match="RSS of its last load"):
            await mod.load(F32)
        assert mod.residents() == {} and mod.residency.refusals == 2


@pytest.mark.model
async def test_the_machine_check_refuses_before_a_worker_starts(store_root, short_runtime_dir):
    async with _module(store_root, short_runtime_dir, min_free_mb=1e9) as mod:
        with pytest.raises(InsufficientMemory, match="the machine has .* MB available") as exc:
            await mod.load(F16)
        assert exc.value.details["available_mb"] > 0
        assert mod.residents() == {}


@pytest.mark.model
async def test_keep_alive_zero_unloads_as_soon_as_idle(store_root, short_runtime_dir):
    async with _module(
        store_root, short_runtime_dir, keep_alive=0, models={F32: {"keep_alive": "forever"}}
    ) as mod:
        await mod.embed(["pinned"], model=F32)
        await mod.embed(["gone soon"], model=F16)
        await _until(lambda: F16 not in mod.residents())
        assert F32 in mod.residents() and mod.residency.unloads == {"keep_alive": 1}


# ---- counted once: a load's reservation and its resident figure never overlap --------------


def _install_faulty(root: Path, name: str, size_mb: int) -> None:
    """An installed embedding model the fault-injection worker serves: a manifest of
    `size_mb` (what the budget estimates), MiniLM's tokenizer, and an artifact nobody reads."""
    mdir = root / name
    mdir.mkdir(parents=True)
    (mdir / "model.gguf").write_bytes(b"")
    shutil.copy(minilm_dir() / "tokenizer.json", mdir / "tokenizer.json")
    manifest = Manifest(
        name=name, format="gguf", kind="embed", digest="0" * 64, size_bytes=size_mb * 2**20,
        dims=4, n_ctx=512, n_ctx_train=512, max_tokens=256, max_tokens_limit=512,
        source="test", created_at="2026-01-01T00:00:00Z", tokenizer="tokenizer.json",
    )  # fmt: skip
    (mdir / MANIFEST_FILE).write_bytes(msgspec.json.encode(manifest))


async def test_a_model_is_counted_once_while_its_first_ping_runs(tmp_path, short_runtime_dir):
    # Two models of ~101 MB (estimated) fit in 250 MB. The first one's worker stops itself on
    # its first PING (the one that measures it once loaded): while that PING is held the
    # model is registered as served yet not measured, and its bytes must count once, so the
    # second load started meanwhile fits.
    for name in ("a", "b"):
        _install_faulty(tmp_path / "models", name, 100)
    cfg = ModuleConfig(
        store_root=str(tmp_path / "models"),
        host=HostConfig(runtime_dir=short_runtime_dir, ping_interval_s=0, ping_window_s=60),
        worker_argv={"llama": WORKER},
    )
    budget = ResidencyConfig(max_resident_mb=250, load_overhead_mb=1)
    async with Module(cfg, residency=budget) as mod:

        async def first() -> None:
            async with mod.residency.hold("a"):  # in use, as a request that loads it is
                await mod.load("a", "llama", {"fault": "sigstop_first_ping"})

        task = asyncio.create_task(first())
        pid = None
        try:
            await _until(lambda: mod.supervisor("a", "llama") is not None)  # served: LOADED
            lane = mod.supervisor("a", "llama")
            pid = lane.state().pid
            await _until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
            assert lane.last_pong is None  # its first PING is on the wire, unanswered
            assert mod.residency.total_mb() == pytest.approx(101)  # once, not twice
            await mod.load("b", "llama")  # 101 + 101 <= 250: admitted
        finally:
            if pid is not None:
                thaw(pid)
            await task
        assert set(mod.residents()) == {"a", "b"} and mod.residency.refusals == 0
        measured = [mod.supervisor(n, "llama").last_pong.rss_mb for n in ("a", "b")]
        assert mod.residency.total_mb() == pytest.approx(sum(measured))

"""The certificate store's save rule under real concurrency and real crashes: readers in other
processes always see a record, concurrent re-certifications of one id all land, history keeps
every earlier record, and a SIGKILL at any instant of a save leaves the old record current."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

from certification.certificate import Certificate, CorpusInfo, Measurements
from certification.fingerprint import Fingerprint
from certification.identity import CertificateKey
from certification.store import CertificateStore
from certification.thresholds import TABLE

_CTX = mp.get_context("spawn")  # a clean interpreter per process, as separate commands are


def make_cert(created_at: str, status: str = "certified") -> Certificate:
    key = CertificateKey(
        model="m",
        lane="llama",
        precision="f16",
        artifact_digest="a" * 64,
        manifest_digest=None,
        kernel_revision=None,
        shapes=(),
        engine="e",
        engine_version="1",
        build_flags="",
        build_options="",
        runtime={},
        os="linux",
    )
    return Certificate(
        id=key.id,
        key=key,
        status=status,
        quality="pass",
        placement="n/a",
        failing=[],
        checks=[],
        thresholds=next(iter(TABLE.values())),
        fingerprint=Fingerprint(
            digest="0" * 64, scheme="s", grid=0.1, n_values=1, n_kept=1, mask=""
        ),
        corpus=CorpusInfo(
            n_items=1,
            n_total=1,
            sample_stride=1,
            digest="d",
            n_queries=0,
            n_documents=0,
            n_probe=0,
        ),
        measurements=Measurements(),
        created_at=created_at,
        duration_s=1.0,
    )


def _save_many(root: str, n: int, status: str = "certified") -> None:
    store = CertificateStore(root)
    for i in range(n):
        store.save(make_cert(f"2026-01-01T00:00:{i % 60:02d}Z", status))


def _read_until(root: str, cert_id: str, stop, misses) -> None:
    store = CertificateStore(root)
    while not stop.is_set():
        if store.get(cert_id) is None:
            misses.value += 1


def _history(root: Path, cert_id: str) -> list[Path]:
    return sorted((root / "history" / cert_id).glob("*.json"))


def test_a_reader_in_another_process_always_sees_a_record(tmp_path):
    first = make_cert("2026-01-01T00:00:00Z")
    CertificateStore(tmp_path).save(first)
    stop, misses = _CTX.Event(), _CTX.Value("i", 0)
    reader = _CTX.Process(target=_read_until, args=(str(tmp_path), first.id, stop, misses))
    reader.start()
    try:
        _save_many(str(tmp_path), 150)
    finally:
        stop.set()
        reader.join(60)
    assert misses.value == 0
    assert len(_history(tmp_path, first.id)) == 150  # each save kept the one it replaced


def test_concurrent_saves_of_one_id_all_land_and_same_second_history_is_kept(tmp_path):
    writers = [
        _CTX.Process(target=_save_many, args=(str(tmp_path), 40, status))
        for status in ("certified", "provisional")
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
    assert [w.exitcode for w in writers] == [0, 0]
    cert_id = make_cert("x").id
    # 80 saves: one current record, 79 in history, though many share a created_at second.
    assert CertificateStore(tmp_path).get(cert_id) is not None
    assert len(_history(tmp_path, cert_id)) == 79
    assert not list(tmp_path.glob(".tmp-*"))


def _save_forever(root: str, saving) -> None:
    store = CertificateStore(root)
    i = 0
    while True:
        i += 1
        store.save(make_cert(f"2026-01-02T00:00:{i % 60:02d}Z", "provisional"))
        saving.set()


def test_a_sigkill_at_any_instant_of_a_save_leaves_a_current_record(tmp_path):
    first = make_cert("2026-01-01T00:00:00Z")
    store = CertificateStore(tmp_path)
    store.save(first)
    rng = random.Random(7)
    for _ in range(8):
        saving = _CTX.Event()
        writer = _CTX.Process(target=_save_forever, args=(str(tmp_path), saving))
        writer.start()
        assert saving.wait(60)
        time.sleep(rng.uniform(0, 0.02))  # the kill must land at an arbitrary instant of a save
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        assert store.get(first.id) is not None and store.latest_for("m", "llama") is not None
    assert len(_history(tmp_path, first.id)) >= 8

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.errors import ProtocolError

INFO = m.EngineInfo(engine="e", version="1", build_flags="AVX2")

TO_WORKER = [
    m.HELLO_ACK(v=3, accept=True, max_frame=1024),
    m.LOAD(
        req_id=1,
        artifact_path="/a",
        artifact_digest="sha",
        format="gguf",
        runtime_config={"n_ctx": 512},
    ),
    m.EMBED_BATCH(req_id=2, model_ref="m", items=[m.EmbedItem(id=0, n_tokens=3)]),
    m.RERANK(req_id=3, model_ref="m", query_n_tokens=2, candidates=[m.RerankCandidate(n_tokens=1)]),
    m.RERANK_SEQUENCES(
        req_id=4, model_ref="m", sequences=[m.RerankSequence(n_tokens=5, n_first=2)]
    ),
    m.CLASSIFY(req_id=10, model_ref="c", sequences=[m.RerankSequence(n_tokens=4, n_first=4)]),
    m.GENERATE(req_id=5, model_ref="g", max_tokens=8, grammar='root ::= "a"'),
    m.ADMIT_SHAPE(req_id=6, model_ref="m", rows=4, seq_len=128, packed=True),
    m.EVICT(req_id=7, model_ref="m", shape_id="s1"),
    m.UNLOAD(req_id=8, model_ref="m"),
    m.PING(req_id=9),
    m.SHUTDOWN(),
]
TO_HOST = [
    m.HELLO(
        v=3,
        nonce="n",
        engine=INFO,
        pid=42,
        max_frame=1024,
        manifest_digest="md",
        kernel_revision="k1",
        packed=True,
    ),
    m.LOADED(req_id=1, model_ref="m", dims=384, cold_load_ms=12.5),
    m.LOADED(
        req_id=1,
        model_ref="m",
        dims=384,
        refuses=[m.Refusal(output="multivector", side="query", reason="no mask")],
    ),
    m.VECTORS(req_id=2, dims=384, n=1),
    m.SCORES(req_id=3),
    m.LABEL_SCORES(req_id=10, n=1, n_labels=3),
    m.TEXT(req_id=5, text="hi", n_prompt=3, n_gen=1, finish_reason="stop"),
    m.SHAPE_ADMITTED(req_id=6, shape_id="s1", cache_hit=False, compile_ms=900.0),
    m.EVICTED(req_id=7, shape_ids=["s1"], freed_bytes=10),
    m.UNLOADED(req_id=8),
    m.PONG(
        req_id=9,
        rss_mb=100.5,
        models_loaded=["m"],
        placement_share=0.95,
        placement_source="estimate",
    ),
    m.PROGRESS(req_id=2, completed=1, phase="inference"),
    m.ERR(req_id=2, code="invalid_request", msg="bad"),
]


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda x: type(x).__name__)
def test_host_to_worker_roundtrip_and_type_tag(msg):
    data = m.encode(msg)
    assert json.loads(data)["type"] == type(msg).__name__
    assert m.decode_from_host(data) == msg


@pytest.mark.parametrize("msg", TO_HOST, ids=lambda x: type(x).__name__)
def test_worker_to_host_roundtrip_and_type_tag(msg):
    data = m.encode(msg)
    assert json.loads(data)["type"] == type(msg).__name__
    assert m.decode_from_worker(data) == msg


def test_every_message_of_the_design_exists_once():
    names = {type(x).__name__ for x in TO_WORKER + TO_HOST}
    assert names == set(
        "HELLO HELLO_ACK LOAD LOADED EMBED_BATCH VECTORS RERANK RERANK_SEQUENCES SCORES GENERATE "
        "TEXT ADMIT_SHAPE SHAPE_ADMITTED EVICT EVICTED UNLOAD UNLOADED PING PONG SHUTDOWN "
        "PROGRESS ERR CLASSIFY LABEL_SCORES".split()
    )


def test_each_direction_decodes_only_its_own_messages():
    with pytest.raises(msgspec.ValidationError):
        m.decode_from_worker(m.encode(m.PING(req_id=1)))
    with pytest.raises(msgspec.ValidationError):
        m.decode_from_host(m.encode(m.PONG(req_id=1, rss_mb=1)))


def test_fields_are_written_even_when_default():
    body = json.loads(m.encode(m.EMBED_BATCH(req_id=1, model_ref="m", items=[])))
    assert body["pooling"] == "mean" and body["normalize"] is True


def test_negative_req_id_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        m.decode_from_host(b'{"type":"PING","req_id":-1}')


def test_ids_roundtrip_is_little_endian_and_zero_copy():
    ids = np.array([1, 2, 70000], dtype=np.int64)
    wire = payloads.ids_to_wire(ids)
    assert bytes(wire) == np.array([1, 2, 70000], dtype="<i4").tobytes()
    view = payloads.ids_view(bytearray(bytes(wire)))
    assert view.tolist() == [1, 2, 70000]
    native = np.arange(4, dtype="<i4")
    assert np.shares_memory(np.frombuffer(payloads.ids_to_wire(native), "<i4"), native)


def test_float_ids_are_refused():
    with pytest.raises(TypeError):
        payloads.ids_to_wire(np.array([1.5]))


def test_raw_length_rule():
    payloads.check_raw_length(12, 3, 4, "x")
    with pytest.raises(ProtocolError, match="header implies 12"):
        payloads.check_raw_length(8, 3, 4, "x")

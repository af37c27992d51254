from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.protocol import messages as m
from workers.protocol import payloads
from workers.protocol.errors import ProtocolError
from workers.protocol.session import (
    HelloReceived,
    HostSession,
    ProgressReceived,
    ReplyReceived,
    RequestReceived,
    ShutdownReceived,
    State,
    WorkerSession,
)

INFO = m.EngineInfo(engine="test", version="0")


def hello(**kw) -> bytes:
    fields = {"v": 3, "nonce": "N", "engine": INFO, "pid": 1, "max_frame": 1024} | kw
    return m.encode(m.HELLO(**fields))


def ready_host() -> HostSession:
    s = HostSession("N", max_frame=4096)
    assert isinstance(s.receive_frame(hello()), HelloReceived)
    ack = s.accept_hello()
    assert ack.max_frame == 1024  # the smaller of both sides
    return s


def embed(req_id=1, n=(2, 1)) -> m.EMBED_BATCH:
    items = [m.EmbedItem(id=i, n_tokens=k) for i, k in enumerate(n)]
    return m.EMBED_BATCH(req_id=req_id, model_ref="x", items=items)


def progress(req_id=1, completed=1, phase="inference") -> bytes:
    return m.encode(m.PROGRESS(req_id=req_id, completed=completed, phase=phase))


# ---- handshake ------------------------------------------------------------------------------


def test_v2_is_rejected_at_hello():
    s = HostSession("N")
    with pytest.raises(ProtocolError, match="version 2"):
        s.receive_frame(hello(v=2))
    assert s.state is State.FAILED


def test_wrong_nonce_is_rejected():
    with pytest.raises(ProtocolError, match="nonce"):
        HostSession("N").receive_frame(hello(nonce="other"))


def test_anything_before_hello_is_a_violation():
    with pytest.raises(ProtocolError, match="expected HELLO"):
        HostSession("N").receive_frame(progress())


def test_frame_between_hello_and_ack_is_a_violation():
    s = HostSession("N")
    s.receive_frame(hello())
    with pytest.raises(ProtocolError):
        s.receive_frame(progress())


def test_unknown_fields_are_ignored_for_foreign_workers():
    raw = (
        b'{"type":"HELLO","v":3,"nonce":"N","engine":{"engine":"rs","version":"1",'
        b'"build_flags":"","extra":1},"pid":9,"max_frame":1024,"future_field":[1,2]}'
    )
    assert isinstance(HostSession("N").receive_frame(raw), HelloReceived)


# ---- requests -------------------------------------------------------------------------------


def test_embed_reply_with_raw_frame():
    s = ready_host()
    s.start_request(embed(), raw_len=3 * 4)
    assert isinstance(s.receive_frame(progress(completed=1)), ProgressReceived)
    assert s.receive_frame(m.encode(m.VECTORS(req_id=1, dims=4, n=2))) is None
    assert s.state is State.AWAIT_RAW
    event = s.receive_frame(np.zeros(8, np.float32).tobytes())
    assert isinstance(event, ReplyReceived) and len(event.raw) == 32
    assert s.state is State.IDLE


def test_request_raw_length_must_match_header():
    s = ready_host()
    with pytest.raises(ProtocolError, match="header implies"):
        s.start_request(embed(), raw_len=8)
    assert s.state is State.IDLE  # nothing was sent; the connection is still fine


def test_req_id_reuse_is_refused():
    s = ready_host()
    s.start_request(m.PING(req_id=5))
    s.receive_frame(m.encode(m.PONG(req_id=5, rss_mb=1.0)))
    with pytest.raises(ProtocolError, match="reused"):
        s.start_request(m.PING(req_id=5))
    with pytest.raises(ProtocolError, match="reused"):
        s.start_request(m.PING(req_id=4))  # an older id is a reuse as well
    s.start_request(m.PING(req_id=6))


@pytest.mark.parametrize(
    "frames, match",
    [
        ([progress(completed=2), progress(completed=2)], "strictly increase"),
        ([progress(completed=2), progress(completed=1)], "strictly increase"),
        ([progress(phase="inference"), progress(completed=2, phase="setup")], "backwards"),
        ([progress(phase="control")], "not allowed"),
        ([progress(req_id=9)], "req_id 9"),
        ([m.encode(m.SCORES(req_id=1))], "does not answer"),
        ([m.encode(m.VECTORS(req_id=2, dims=4, n=2))], "expected 1"),
        ([m.encode(m.VECTORS(req_id=1, dims=4, n=3))], "3 items|n=3"),
        ([m.encode(m.VECTORS(req_id=1, dims=4, n=2)), b"\x00" * 28], "header implies 32"),
        ([m.encode(m.VECTORS(req_id=1, dims=4, n=2)), progress(completed=5)], "header implies"),
        ([b"not json"], "undecodable"),
        ([m.encode(m.HELLO(v=3, nonce="N", engine=INFO, pid=1))], "HELLO for req_id None"),
    ],
)
def test_violations_during_a_request(frames, match):
    s = ready_host()
    s.start_request(embed(), raw_len=12)
    with pytest.raises(ProtocolError, match=match):
        for f in frames:
            s.receive_frame(f)
    assert s.state is State.FAILED


def test_setup_then_inference_then_reply_is_valid():
    s = ready_host()
    s.start_request(embed(), raw_len=12)
    s.receive_frame(progress(completed=1, phase="setup"))
    s.receive_frame(progress(completed=2, phase="setup"))
    s.receive_frame(progress(completed=3, phase="inference"))
    assert s.current.phase == "inference"
    s.receive_frame(m.encode(m.ERR(req_id=1, code="invalid_request", msg="no")))
    assert s.state is State.IDLE


def test_control_request_phases():
    s = ready_host()
    s.start_request(m.LOAD(req_id=1, artifact_path="/a", artifact_digest="d", format="gguf"))
    s.receive_frame(progress(phase="setup"))
    s.receive_frame(progress(completed=2, phase="control"))
    with pytest.raises(ProtocolError):
        s.receive_frame(progress(completed=3, phase="inference"))


def test_unsolicited_frame_when_idle_is_a_violation():
    s = ready_host()
    with pytest.raises(ProtocolError, match="unsolicited"):
        s.receive_frame(m.encode(m.PONG(req_id=1, rss_mb=1)))


def test_scores_length_follows_the_request():
    s = ready_host()
    req = m.RERANK(
        req_id=1, model_ref="r", query_n_tokens=2, candidates=[m.RerankCandidate(n_tokens=1)] * 3
    )
    s.start_request(req, raw_len=5 * 4)
    s.receive_frame(m.encode(m.SCORES(req_id=1)))
    assert isinstance(s.receive_frame(b"\x00" * 12), ReplyReceived)


def classify(req_id=1, n=(3, 5)) -> m.CLASSIFY:
    seqs = [m.RerankSequence(n_tokens=k, n_first=k) for k in n]
    return m.CLASSIFY(req_id=req_id, model_ref="c", sequences=seqs)


def test_label_scores_carry_n_rows_of_n_labels():
    s = ready_host()
    s.start_request(classify(), raw_len=8 * 4)
    s.receive_frame(progress(completed=1))
    assert s.receive_frame(m.encode(m.LABEL_SCORES(req_id=1, n=2, n_labels=3))) is None
    event = s.receive_frame(np.zeros(6, np.float32).tobytes())
    assert isinstance(event, ReplyReceived) and len(event.raw) == 24
    assert s.state is State.IDLE


@pytest.mark.parametrize(
    "frames, match",
    [
        # a count that is not the request's: one row per sequence, at least one label
        ([m.encode(m.LABEL_SCORES(req_id=1, n=3, n_labels=3))], "n=3 for 2 sequences"),
        ([m.encode(m.LABEL_SCORES(req_id=1, n=2, n_labels=0))], "n_labels=0"),
        ([b'{"type":"LABEL_SCORES","req_id":1,"n":-1,"n_labels":3}'], "undecodable"),
        # a frame of the wrong length: never truncated or reshaped
        ([m.encode(m.LABEL_SCORES(req_id=1, n=2, n_labels=3)), b"\x00" * 20], "implies 24"),
        ([m.encode(m.LABEL_SCORES(req_id=1, n=2, n_labels=3)), b"\x00" * 28], "implies 24"),
        ([m.encode(m.SCORES(req_id=1))], "does not answer CLASSIFY"),
    ],
)
def test_label_scores_violations(frames, match):
    s = ready_host()
    s.start_request(classify(), raw_len=8 * 4)
    with pytest.raises(ProtocolError, match=match):
        for f in frames:
            s.receive_frame(f)
    assert s.state is State.FAILED


def encode_req(outputs=("dense", "tokens", "sparse", "multivector"), n=(3, 2)) -> m.ENCODE:
    items = [m.EmbedItem(id=i, n_tokens=k) for i, k in enumerate(n)]
    return m.ENCODE(req_id=1, model_ref="e", items=items, outputs=list(outputs))


def encoded(**over) -> m.ENCODED:
    sections = {
        "dense": m.OutputSection(kind="dense", dims=4),
        "tokens": m.OutputSection(kind="tokens", dims=4, counts=[3, 2]),
        "sparse": m.OutputSection(kind="sparse", dims=100, counts=[2, 0]),
        "multivector": m.OutputSection(kind="multivector", dims=2, counts=[1, 2]),
    }
    sections.update(over)
    return m.ENCODED(req_id=1, n=2, sections=list(sections.values()))


def test_encoded_carries_its_sections_back_to_back():
    s = ready_host()
    s.start_request(encode_req(), raw_len=5 * 4)
    s.receive_frame(progress(completed=1))
    assert s.receive_frame(m.encode(encoded())) is None
    dense = np.arange(8, dtype="<f4")
    tokens = np.arange(20, dtype="<f4") + 100
    sparse = np.array([7, 9], "<i4").tobytes() + np.array([0.5, 1.5], "<f4").tobytes()
    multi = np.arange(6, dtype="<f4") + 200
    frame = dense.tobytes() + tokens.tobytes() + sparse + multi.tobytes()
    event = s.receive_frame(frame)
    assert isinstance(event, ReplyReceived) and s.state is State.IDLE
    got = payloads.encoded_sections(event.reply, event.raw)
    assert np.array_equal(got[0], dense.reshape(2, 4))
    assert np.array_equal(got[1], tokens.reshape(5, 4))
    assert got[2][0].tolist() == [7, 9] and got[2][1].tolist() == [0.5, 1.5]
    assert np.array_equal(got[3], multi.reshape(3, 2))


@pytest.mark.parametrize(
    "reply, raw, match",
    [
        # counts that are not the request's
        (m.ENCODED(req_id=1, n=3, sections=encoded().sections), None, "n=3 for 2 items"),
        (
            encoded(tokens=m.OutputSection(kind="tokens", dims=4, counts=[3, 1])),
            None,
            "tokens count 1 for item 1 of 2 tokens",
        ),
        (
            encoded(sparse=m.OutputSection(kind="sparse", dims=100, counts=[2])),
            None,
            "sparse has 1 counts for 2 items",
        ),
        (encoded(dense=m.OutputSection(kind="dense", dims=0)), None, "dense dims=0"),
        (m.ENCODED(req_id=1, n=2, sections=encoded().sections[:3]), None, "sections"),
        # a frame of the wrong length: never truncated or reshaped
        (encoded(), b"\x00" * 4 * 37, "implies 152"),
        (encoded(), b"\x00" * 4 * 39, "implies 152"),
    ],
)
def test_encoded_violations(reply, raw, match):
    s = ready_host()
    s.start_request(encode_req(), raw_len=5 * 4)
    with pytest.raises(ProtocolError, match=match):
        s.receive_frame(m.encode(reply))
        s.receive_frame(raw)
    assert s.state is State.FAILED


def test_classify_ids_frame_must_match_the_sequences():
    with pytest.raises(ProtocolError, match="header implies 32"):
        ready_host().start_request(classify(), raw_len=7 * 4)
    w = WorkerSession()
    w.receive_frame(m.encode(m.HELLO_ACK(v=3, accept=True, max_frame=99)))
    assert w.receive_frame(m.encode(classify())) is None
    with pytest.raises(ProtocolError, match="header implies 32"):
        w.receive_frame(np.arange(9, dtype="<i4").tobytes())


def test_generate_accepts_any_whole_number_of_ids():
    s = ready_host()
    s.start_request(m.GENERATE(req_id=1, model_ref="g", max_tokens=4), raw_len=40)
    s2 = ready_host()
    with pytest.raises(ProtocolError, match="multiple of 4"):
        s2.start_request(m.GENERATE(req_id=1, model_ref="g", max_tokens=4), raw_len=41)


# ---- worker side ----------------------------------------------------------------------------


def test_worker_session_assembles_request_with_ids():
    w = WorkerSession()
    assert w.receive_frame(m.encode(m.HELLO_ACK(v=3, accept=True, max_frame=99))) is None
    assert w.max_frame == 99
    assert w.receive_frame(m.encode(embed())) is None
    event = w.receive_frame(np.arange(3, dtype="<i4").tobytes())
    assert isinstance(event, RequestReceived) and event.request.items[0].n_tokens == 2
    assert isinstance(w.receive_frame(m.encode(m.SHUTDOWN())), ShutdownReceived)


def test_worker_session_refuses_a_rejecting_ack():
    with pytest.raises(ProtocolError, match="refused"):
        WorkerSession().receive_frame(m.encode(m.HELLO_ACK(v=3, accept=False, max_frame=1)))
    with pytest.raises(ProtocolError, match="expected HELLO_ACK"):
        WorkerSession().receive_frame(m.encode(m.PING(req_id=1)))


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=80), max_size=6))
def test_host_session_on_arbitrary_frames_yields_events_or_protocol_error(frames):
    s = ready_host()
    s.start_request(embed(), raw_len=12)
    try:
        for f in frames:
            event = s.receive_frame(f)
            assert event is None or isinstance(event, ProgressReceived | ReplyReceived)
    except ProtocolError:
        assert s.state is State.FAILED

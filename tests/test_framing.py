from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.protocol.errors import ProtocolError
from workers.protocol.framing import NEED_DATA, FrameDecoder, encode_frame, frame_header


def drain(decoder: FrameDecoder) -> list[bytes]:
    out = []
    while (frame := decoder.next_frame()) is not NEED_DATA:
        out.append(bytes(frame))
    return out


def test_header_is_u32_little_endian():
    assert frame_header(1) == b"\x01\x00\x00\x00"
    assert frame_header(0x01020304) == b"\x04\x03\x02\x01"
    with pytest.raises(ProtocolError):
        frame_header(2**32)


def test_partial_header_and_body_need_data():
    d = FrameDecoder()
    d.receive_data(b"\x05\x00")
    assert d.next_frame() is NEED_DATA
    d.receive_data(b"\x00\x00hel")
    assert d.next_frame() is NEED_DATA and d.in_frame
    d.receive_data(b"lo")
    assert d.next_frame() == b"hello"
    assert not d.in_frame


def test_zero_length_frame():
    d = FrameDecoder()
    d.receive_data(encode_frame(b"") + encode_frame(b"x"))
    assert drain(d) == [b"", b"x"]


def test_over_max_frame_fails_at_header_and_stays_failed():
    d = FrameDecoder(max_frame=16)
    d.receive_data(frame_header(17))
    with pytest.raises(ProtocolError, match="exceeds max_frame"):
        d.next_frame()
    with pytest.raises(ProtocolError):
        d.get_buffer()


def test_exactly_max_frame_is_accepted():
    d = FrameDecoder(max_frame=16)
    d.receive_data(encode_frame(b"a" * 16))
    assert drain(d) == [b"a" * 16]


def test_large_frame_is_filled_in_place_without_copies():
    d = FrameDecoder(scratch=64)
    payload = bytes(range(256)) * 40
    d.receive_data(frame_header(len(payload)) + payload[:10])
    buf = d.get_buffer()
    assert len(buf) == len(payload) - 10  # the socket may fill the rest directly
    buf[:] = payload[10:]
    d.buffer_updated(len(payload) - 10)
    frame = d.next_frame()
    assert isinstance(frame, memoryview) and bytes(frame) == payload


def test_reused_large_buffer_is_one_allocation():
    d = FrameDecoder(scratch=64, reuse_large=True)
    d.receive_data(encode_frame(b"A" * 500))
    first = d.next_frame()
    d.receive_data(encode_frame(b"B" * 400))
    second = d.next_frame()
    assert bytes(second) == b"B" * 400
    assert bytes(first[:400]) == b"B" * 400  # same memory: valid only until the next read


def test_frames_following_a_large_frame():
    d = FrameDecoder(scratch=64)
    big = b"B" * 1000
    d.receive_data(encode_frame(big) + encode_frame(b"small") + encode_frame(big))
    assert drain(d) == [big, b"small", big]


frames_st = st.lists(st.binary(max_size=300), max_size=12)


@settings(max_examples=200, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(min_value=1, max_value=97), max_size=40))
def test_any_chunking_of_a_valid_stream_yields_the_same_frames(frames, cuts):
    stream = b"".join(encode_frame(f) for f in frames)
    d = FrameDecoder(scratch=128)  # small scratch: exercises compaction and in-place bodies
    got: list[bytes] = []
    pos = 0
    for cut in cuts:
        d.receive_data(stream[pos : pos + cut])
        pos += cut
        got += drain(d)
    d.receive_data(stream[pos:])
    got += drain(d)
    assert got == frames
    assert not d.in_frame


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2000), chunk=st.integers(min_value=1, max_value=64))
def test_any_bytes_yield_frames_or_the_typed_protocol_error(data, chunk):
    d = FrameDecoder(max_frame=512, scratch=128)
    try:
        for i in range(0, len(data), chunk):
            d.receive_data(data[i : i + chunk])
            for frame in drain(d):
                assert len(frame) <= 512
    except ProtocolError as exc:
        assert "max_frame" in exc.reason
        # Only a header that really declared too much can fail the stream.
        assert any(struct.unpack_from("<I", data, i)[0] > 512 for i in range(0, len(data) - 3))

"""Wire protocol v3: the seam between the host and its workers (imported by both sides).

- `messages`: msgspec structs for every control frame, one decoder per direction.
- `framing`: sans-IO u32-LE length framing with zero-copy large frames.
- `payloads`: raw i32/f32 payload views and the exact-length rule.
- `session`: per-connection state machines (handshake, request, PROGRESS validation).
- `blocking`: the few lines that put the above on a blocking socket (workers).
"""

from workers.protocol.errors import ProtocolError
from workers.protocol.framing import NEED_DATA, FrameDecoder, encode_frame, frame_header
from workers.protocol.messages import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    WORKER_ERROR_CODES,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "WORKER_ERROR_CODES",
    "FrameDecoder",
    "ProtocolError",
    "encode_frame",
    "frame_header",
]

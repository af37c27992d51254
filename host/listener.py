"""The host-side Unix socket a worker connects to, and who is on the other end.

The HOST creates the listener before spawning (so a crash-looping worker never races a stale
socket file): `<runtime_dir>/synapse/workers/<worker_id>.<random>.sock`, directory 0700,
socket 0600, a stale file unlinked first (the random part: two hosts may run lanes of the same
id over one runtime dir). macOS allows only 104 bytes and its $TMPDIR alone is ~50 (60 on
some hosts): when the readable path does not fit, `<runtime_dir>/synapse/w/<12 hex>.sock`
(a digest of the worker id) is used, which fits under a 60-character $TMPDIR.
Peer credentials: same uid, and the peer process must be the spawned child or in its process
group (a shell wrapper may exec or fork the real worker).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import sys
from pathlib import Path

from host.errors import ConfigInvalid

# sun_path holds the path plus its NUL: 104 bytes on macOS, 108 on Linux.
SUN_PATH_MAX = 104 if sys.platform == "darwin" else 108


def socket_path(runtime_dir: Path, worker_id: str) -> Path:
    readable = runtime_dir / "synapse" / "workers" / f"{worker_id}.sock"
    if _fits(readable):
        return readable
    digest = hashlib.sha256(worker_id.encode()).hexdigest()[:12]
    return runtime_dir / "synapse" / "w" / f"{digest}.sock"


def _fits(path: Path) -> bool:
    return len(os.fsencode(str(path))) < SUN_PATH_MAX


def check_path_length(path: Path) -> None:
    size = len(os.fsencode(str(path)))
    if not _fits(path):
        raise ConfigInvalid(
            f"worker socket path is {size} bytes; this OS allows {SUN_PATH_MAX - 1}: {path} "
            "(set HostConfig.runtime_dir to a shorter directory)"
        )


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigInvalid(f"{path} is owned by uid {st.st_uid}, not us")
    os.chmod(path, 0o700)


def create_listener(path: Path) -> socket.socket:
    check_path_length(path)
    _private_dir(path.parent.parent)
    _private_dir(path.parent)
    try:
        path.unlink()  # stale socket of a previous generation
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # the socket file is born 0600: no window with wider rights
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the connected peer where the OS tells, else None."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid
    if sys.platform == "darwin":
        # LOCAL_PEERPID (SOL_LOCAL=0, 2) gives the pid; getpeereid's uid is not exposed, so
        # the 0700 directory is what keeps other users out there.
        raw = sock.getsockopt(0, 2, 4)
        return struct.unpack("i", raw)[0], os.getuid()
    return None


def peer_is_child(peer_pid: int, child_pid: int) -> bool:
    if peer_pid == child_pid:
        return True
    try:
        return os.getpgid(peer_pid) == child_pid  # the child leads its own process group
    except ProcessLookupError:
        return False

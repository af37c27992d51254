from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from host.errors import ConfigInvalid
from host.listener import SUN_PATH_MAX, create_listener, peer_credentials, socket_path


def test_listener_dir_0700_socket_0600_and_stale_file_replaced(short_runtime_dir):
    path = socket_path(Path(short_runtime_dir), "lane-1")
    path.parent.mkdir(parents=True)
    path.write_text("stale")  # a previous generation's leftover
    sock = create_listener(path)
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        sock.setblocking(True)
        server, _ = sock.accept()
        pid, uid = peer_credentials(server)
        assert (pid, uid) == (os.getpid(), os.getuid())
        client.close()
        server.close()
    finally:
        sock.close()


def test_path_length_limit_is_a_clear_error(short_runtime_dir):
    long_dir = Path(short_runtime_dir) / ("d" * (SUN_PATH_MAX - len(short_runtime_dir)))
    with pytest.raises(ConfigInvalid, match="shorter directory"):
        create_listener(socket_path(long_dir, "w"))

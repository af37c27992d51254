"""Shared fixtures. Protocol windows are shortened by configuration, never slept through."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


@pytest.fixture
def short_runtime_dir():
    # pytest's tmp_path can exceed the 107-byte sun_path limit; sockets need a short dir.
    path = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)

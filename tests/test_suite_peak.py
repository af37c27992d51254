"""scripts/suite_peak.py measures what a command's process tree holds: a child of a child that
maps 200 MiB is counted, and the command's exit code is passed through."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRANDCHILD = (
    "import subprocess, sys; subprocess.run([sys.executable, '-c', "
    "'import time; x = bytearray(200 << 20); time.sleep(1.5)'], check=True); "
    "sys.exit(3)"
)


def test_the_peak_counts_grandchildren_and_keeps_the_exit_code():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "suite_peak.py"),
            "--",
            sys.executable,
            "-c",
            GRANDCHILD,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["returncode"] == 3 and out["peak_processes"] >= 2
    assert 200 <= out["peak_tree_pss_mib"] <= out["peak_tree_rss_mib"] + 1


def test_without_a_command_it_says_how_to_call_it():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "suite_peak.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "suite_peak.py -- make test" in proc.stderr

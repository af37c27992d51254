"""Run a command and report the peak memory and disk it took, as one JSON object.

    .venv/bin/python scripts/suite_peak.py -- make test

Memory: the command's whole process tree (pytest, every worker, every server it starts),
sampled every 0.25 s, as summed PSS (each shared page, such as the GGUF weights several
workers map, split among the processes that map it: what the tree really holds) and summed
RSS (which counts a shared page once per process, so it over-states). Disk: growth of the
used bytes on the filesystems holding the temp dir and the working directory (sampled the
same way; other writers on the machine count too, so run it on an idle machine). For sizing
a CI runner (a hosted macOS runner has 7 GB of memory and 14 GB of disk).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(summed PSS, summed RSS) of `proc` and its descendants; PSS falls back to RSS where
    the OS does not report it."""
    pss = rss = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return pss, rss


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    paths = {os.path.realpath(tempfile.gettempdir()), os.path.realpath(os.getcwd())}
    devices = {os.stat(p).st_dev: p for p in paths}
    base = {d: shutil.disk_usage(p).used for d, p in devices.items()}
    start = time.monotonic()
    child = subprocess.Popen(argv[1:])
    proc = psutil.Process(child.pid)
    peak_pss = peak_rss = peak_disk = 0
    peak_procs = 0
    while child.poll() is None:
        pss, rss = tree_memory(proc)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        try:
            peak_procs = max(peak_procs, 1 + len(proc.children(recursive=True)))
        except psutil.Error:
            pass
        grown = sum(shutil.disk_usage(p).used - base[d] for d, p in devices.items())
        peak_disk = max(peak_disk, grown)
        time.sleep(0.25)
    print(
        json.dumps(
            {
                "command": argv[1:],
                "returncode": child.returncode,
                "seconds": round(time.monotonic() - start, 1),
                "peak_tree_pss_mib": round(peak_pss / 2**20),
                "peak_tree_rss_mib": round(peak_rss / 2**20),
                "peak_processes": peak_procs,
                "peak_disk_growth_mib": round(peak_disk / 2**20),
                "disk_watched": sorted(devices.values()),
            }
        )
    )
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

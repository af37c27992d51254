"""One local Ray for the whole test session, and the check that nothing of ours outlives it.

`host.local_ray.start_local_ray(num_cpus=2)` (loopback, token on: the Ray `serve --ray` and
`batch embed --ray` start) in a short private temp dir (Ray's sockets live there); at session end
`ray.shutdown()` and then no Ray process of that dir and no engine worker spawned under
`runtime_dir` may be left (psutil, by command line).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
import time

import psutil


def our_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker` (a temp or runtime dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if marker in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(marker: str, timeout_s: float = 30.0) -> list[psutil.Process]:
    """Processes still alive after `timeout_s` (they exit asynchronously after a stop)."""
    procs = our_processes(marker)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


def start_ray(attempts: int = 3):
    """ray.init, retried: on a loaded 2-core machine Ray's raylet can give up waiting for its
    own agents (a hard-coded startup wait) before they come up; a failed start is cleaned up
    (its processes killed, its dir removed) before the next attempt."""
    import ray

    from host.local_ray import start_local_ray

    # The agents report their ports within this window (Ray's default is far shorter).
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    for attempt in range(1, attempts + 1):
        temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        started = time.monotonic()
        try:
            start_local_ray(
                num_cpus=2, log_to_driver=False, _temp_dir=temp_dir, configure_logging=False
            )
            return ray, temp_dir, time.monotonic() - started
        except Exception as exc:
            if attempt == attempts or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
            for proc in our_processes(temp_dir):
                proc.kill()
            wait_gone(temp_dir, timeout_s=10)
            shutil.rmtree(temp_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def stop_ray(ray, temp_dir: str) -> list[psutil.Process]:
    ray.shutdown()
    left = wait_gone(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return left


def listening_sockets(root: psutil.Process | None = None) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `root` (this process by
    default: the driver) and its descendants — the local Ray's GCS, raylet, agents and every
    worker and actor are."""
    root = root or psutil.Process()
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1, a dual-stack bind
        ip = ip.ipv4_mapped
    return ip.is_loopback

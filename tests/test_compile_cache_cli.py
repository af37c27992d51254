"""`python -m compile_cache ...` as a user runs it: real subprocesses against a real cache."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile_cache import CompileCache, Entry, default_root
from compile_cache.cli import add_cache_parser

REPO = Path(__file__).resolve().parents[1]


def cli(
    *args: str, cache_dir: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(cache_dir), "COLUMNS": "120"}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "compile_cache", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def as_json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout)


def populate(cache_dir: Path, sizes: list[int]) -> tuple[CompileCache, list[Entry]]:
    cache = CompileCache(cache_dir / "compile_cache", touch_interval=0)
    entries = []
    for i, size in enumerate(sizes):
        key = {"manifest_digest": "ab" * 32, "shape": [1, 128 * (i + 1)], "precision": "fp16"}

        def build(tmp: Path, size: int = size) -> None:
            (tmp / "model.mlpackage").mkdir()
            (tmp / "model.mlpackage" / "weights.bin").write_bytes(b"w" * size)

        entries.append(cache.get_or_build(key, build))
    return cache, entries


def test_ls_du_human_and_json(tmp_path: Path) -> None:
    cache, entries = populate(tmp_path, [3 * 2**20, 1000])
    proc = cli("ls", "--json", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = as_json(proc)
    assert listed["root"] == str(cache.root)
    assert [e["digest"] for e in listed["entries"]] == [e.digest for e in reversed(entries)]
    assert listed["entries"][1]["size"] == 3 * 2**20
    assert listed["entries"][1]["key"]["shape"] == [1, 128]
    assert listed["entries"][1]["leased"] is False

    human = cli("ls", cache_dir=tmp_path)
    assert human.returncode == 0, human.stderr
    assert entries[0].digest[:12] in human.stdout
    assert "3.0 MiB" in human.stdout and "1000 B" in human.stdout
    assert "ago" in human.stdout or "just now" in human.stdout
    assert "shape=[1,128]" in human.stdout and "precision=fp16" in human.stdout

    du = as_json(cli("du", "--json", cache_dir=tmp_path))
    assert du["entries"] == 2 and du["total_bytes"] == 3 * 2**20 + 1000
    human_du = cli("du", cache_dir=tmp_path, extra_env={"SYNAPSE_CACHE_BUDGET": "1GiB"})
    assert "3.0 MiB" in human_du.stdout and "1.0 GiB" in human_du.stdout


def test_verify_reports_and_evicts_corruption(tmp_path: Path) -> None:
    cache, (bad, good) = populate(tmp_path, [2000, 2000])
    assert cli("verify", "--json", cache_dir=tmp_path).returncode == 0
    weights = bad.path / "model.mlpackage" / "weights.bin"
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[7] ^= 0xFF
    weights.write_bytes(bytes(data))

    proc = cli("verify", "--json", cache_dir=tmp_path)
    assert proc.returncode == 1
    report = as_json(proc)
    assert report["checked"] == 2 and report["ok"] == 1
    assert report["corrupt"] == [
        {
            "digest": bad.digest,
            "evicted": True,
            "reasons": ["content changed: model.mlpackage/weights.bin"],
        }
    ]
    assert [e.digest for e in cache.ls()] == [good.digest]
    human = cli("verify", cache_dir=tmp_path)
    assert human.returncode == 0 and "1 ok, 0 corrupt" in human.stdout


def test_gc_with_budget_and_bad_size(tmp_path: Path) -> None:
    cache, entries = populate(tmp_path, [1000, 1000, 1000])
    cache.get(entries[0].key)  # LRU: 1, 2, 0
    report = as_json(cli("gc", "--budget", "2K", "--json", cache_dir=tmp_path))
    assert report["evicted"] == [entries[1].digest]
    assert report["budget_bytes"] == 2048 and report["after_bytes"] == 2000

    human = cli("gc", "--budget", "1000", cache_dir=tmp_path)
    assert human.returncode == 0
    assert "evicted 1 entry" in human.stdout and "freed 1000 B" in human.stdout

    bad = cli("gc", "--budget", "lots", "--json", cache_dir=tmp_path)
    assert bad.returncode == 2
    assert as_json(bad)["error"]["code"] == "invalid_size"
    bad_human = cli("gc", "--budget", "12XB", cache_dir=tmp_path)
    assert bad_human.returncode == 2 and "invalid size '12XB'" in bad_human.stderr
    assert [e.digest for e in cache.ls()] == [entries[0].digest]


def test_evict_by_prefix_or_json_key_and_errors(tmp_path: Path) -> None:
    cache, entries = populate(tmp_path, [10, 20, 30])
    proc = cli("evict", entries[0].digest[:10], "--json", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert as_json(proc)["evicted"] == [entries[0].digest]

    key_text = json.dumps(entries[1].key)
    human = cli("evict", key_text, cache_dir=tmp_path)
    assert human.returncode == 0 and entries[1].digest[:12] in human.stdout

    missing = cli("evict", entries[0].digest[:10], "--json", cache_dir=tmp_path)
    assert missing.returncode == 2 and as_json(missing)["error"]["code"] == "not_found"
    nonsense = cli("evict", "not-a-digest", cache_dir=tmp_path)
    assert nonsense.returncode == 2 and "[invalid_selector]" in nonsense.stderr
    bad_key = cli("evict", '{"shape": null}', "--json", cache_dir=tmp_path)
    assert as_json(bad_key)["error"]["code"] == "invalid_key"
    assert [e.digest for e in cache.ls()] == [entries[2].digest]


def test_clear_and_root_option(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    cache = CompileCache(other)
    cache.get_or_build({"k": 1}, lambda tmp: (tmp / "a").write_text("a"))
    # --root wins over $SYNAPSE_CACHE_DIR, before or after the subcommand.
    empty = as_json(cli("ls", "--json", cache_dir=tmp_path / "env"))
    assert empty["entries"] == []
    assert (
        len(as_json(cli("--root", str(other), "ls", "--json", cache_dir=tmp_path))["entries"]) == 1
    )
    proc = cli("clear", "--root", str(other), "--json", cache_dir=tmp_path)
    assert proc.returncode == 0 and len(as_json(proc)["evicted"]) == 1
    assert cache.ls() == []


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    proc = cli("frobnicate", cache_dir=tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    assert cli(cache_dir=tmp_path).returncode == 2  # a command is required


def test_add_cache_parser_plugs_into_a_host_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(tmp_path))
    assert default_root() == tmp_path / "compile_cache"
    parser = argparse.ArgumentParser(prog="synapse")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve").set_defaults(func=lambda args: 99)
    add_cache_parser(sub)
    args = parser.parse_args(["cache", "du", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["root"] == str(tmp_path / "compile_cache")
    serve = parser.parse_args(["serve"])
    assert serve.func(serve) == 99

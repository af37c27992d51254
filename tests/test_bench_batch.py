"""bench.batch's ceiling shards: real processes on the default model, fed by a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.batch import write_corpus

REPO = Path(__file__).resolve().parent.parent


def _shard(corpus: Path, cache_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "bench.batch", "--shard", "0/1", "--corpus", str(corpus)]
    argv += ["--max-worker-batch-tokens", "512", "--max-batch-items", "32"]
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.model
def test_a_shard_computes_on_go_and_nothing_once_its_bench_is_gone(synapse_cache_dir, tmp_path):
    """A shard waits at "ready" for "go". End of input there means the bench that started it
    died (its pipe closed): it used to take that for "go" and compute its whole share, in a
    session of its own, for nobody."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, 48)
    told, orphaned = _shard(corpus, synapse_cache_dir), _shard(corpus, synapse_cache_dir)
    try:
        for shard in (told, orphaned):
            assert shard.stdout is not None and shard.stdout.readline().strip() == "ready"
        out, _ = told.communicate("go\n", timeout=120)
        assert told.returncode == 0 and '"rows": 48' in out
        out, _ = orphaned.communicate("", timeout=120)  # its stdin closes: end of input
        assert orphaned.returncode == 0 and out == ""
    finally:
        for shard in (told, orphaned):
            if shard.poll() is None:
                shard.kill()
                shard.wait()

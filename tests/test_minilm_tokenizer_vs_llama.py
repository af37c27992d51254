"""MiniLM: the module's HF tokenizer vs llama.cpp's own WordPiece on the same GGUF vocab.

The module tokenizes (workers get ids), so serving follows the model's own tokenizer.json —
what sentence-transformers uses. This test documents where llama.cpp's tokenizer would have
differed: its WPM normalization drops Indic vowel signs (Devanagari, Bengali, Tamil) and
splits Hangul syllables into jamo. Everything else must agree exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from certification.corpus import SENTENCES, SHORT
from host.sanitize import sanitize
from host.tokenization import Tokenizer
from ingest.store import ArtifactStore

pytestmark = pytest.mark.model  # builds or loads a real model, or starts a model worker

KNOWN_DIFFERENT_SCRIPTS = [(0x0900, 0x0DFF), (0x1100, 0x11FF), (0x3130, 0x318F), (0xAC00, 0xD7AF)]

LLAMA = r"""
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(sys.stdin)
print(json.dumps([llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]))
"""


def _in_known_scripts(text: str) -> bool:
    return any(lo <= ord(ch) <= hi for ch in text for lo, hi in KNOWN_DIFFERENT_SCRIPTS)


def test_minilm_tokenization_agrees_except_documented_scripts(store_root):
    rec = ArtifactStore(store_root).get("minilm-l6-v2")
    texts = [sanitize(t) for t in SENTENCES + SHORT]
    proc = subprocess.run(
        [sys.executable, "-c", LLAMA, str(rec.artifact_path)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "passive"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = Tokenizer.from_file(rec.tokenizer_path, max_tokens=4096, hard_limit=4096)
    ours = [ids.tolist() for ids in tok.encode(texts, truncate=False).ids]
    differ = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert all(_in_known_scripts(t) for t in differ), [
        t for t in differ if not _in_known_scripts(t)
    ]
    assert len(texts) - len(differ) >= 95  # 99 of 105 agree at the time of writing

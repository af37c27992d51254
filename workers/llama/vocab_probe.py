"""llama.cpp's own tokenization of texts, from a GGUF's vocabulary alone (`vocab_only`).

    python -m workers.llama.vocab_probe < {"model": PATH, "texts": [...]}   (JSON on stdin)
    -> [{"special": [...ids with BOS/SEP...], "plain": [...ids without...]}, ...]   (stdout)

Ingest proves a derived module-side tokenizer equal to this, text by text. It runs as its own
process for the same reason the engine does: llama.cpp may abort on a vocabulary it dislikes,
and the host never imports llama_cpp. Text is tokenized with `special=False` (special-token
strings written in the text are text, the host's policy); "special" adds the model's
BOS/EOS/SEP as llama.cpp does for a whole input, "plain" adds none (rerank segments).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PROBE_TIMEOUT_S = 600


class ProbeFailed(RuntimeError):
    """llama.cpp could not load the vocabulary or died while tokenizing (its log attached)."""


def tokenize_with_llama(gguf: str | Path, texts: Sequence[str]) -> list[dict[str, list[int]]]:
    """Run the probe in a child process; raises ProbeFailed with the child's last words."""
    request = json.dumps({"model": str(gguf), "texts": list(texts)})
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "workers.llama.vocab_probe"],
            input=request,
            capture_output=True,
            text=True,
            env=env,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise ProbeFailed(f"llama.cpp's tokenizer took over {PROBE_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        raise ProbeFailed(
            f"llama.cpp could not tokenize with {gguf} (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}"
        )
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise ProbeFailed(f"unreadable answer from the tokenizer probe: {e}") from e
    if not isinstance(out, list) or len(out) != len(texts):
        raise ProbeFailed("the tokenizer probe answered for the wrong number of texts")
    return out


def _main() -> int:
    import llama_cpp

    request = json.load(sys.stdin)
    llm = llama_cpp.Llama(request["model"], vocab_only=True, verbose=False)
    out = []
    for text in request["texts"]:
        raw = text.encode("utf-8")
        out.append(
            {
                "special": llm.tokenize(raw, add_bos=True, special=False),
                "plain": llm.tokenize(raw, add_bos=False, special=False),
            }
        )
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())

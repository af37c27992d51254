"""GGUFs as llama.cpp's own converter writes them: `convert_hf_to_gguf.py` (and its
`conversion/` package and `gguf-py`) from the source archive of the llama-cpp-python version
pyproject.toml pins, run in a child process over tiny models the tests build.

The archive is the one pip builds the wheel from; it is kept under the user cache dir
(`synapse/sdist/`), fetched there once with pip (`pip download --no-binary`) when absent, and
only the converter's files are unpacked beside it.

One thing differs from running the script by hand: llama.cpp's converter names a byte-level
BPE pre-tokenizer by hashing how the checkpoint's tokenizer splits a fixed text, a hash a tiny
vocabulary trained here can never reproduce. A job may therefore say which name the real
checkpoint of its family gets from the converter's table (`get_vocab_base_pre`: e.g.
"modern-bert" for answerdotai/ModernBERT-base, "qwen2" for Qwen/Qwen3-Embedding-0.6B); the
child uses it only where the converter would otherwise stop on an unknown hash. Everything else
(tensors, padding, token types, special tokens, metadata) is the converter's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import version as installed_version
from pathlib import Path


def pinned_version() -> str:
    # The installed llama-cpp-python is the pinned one (the lock file installs it).
    return installed_version("llama-cpp-python")


_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "synapse"


def sdist() -> Path:
    """The pinned llama-cpp-python source archive, fetched once with pip when absent."""
    version = pinned_version()
    folder = _cache() / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(folder),
            f"llama-cpp-python=={version}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return folder / f"llama_cpp_python-{version}.tar.gz"


def converter_dir() -> Path:
    """The unpacked converter (script, `conversion/`, `gguf-py/`), unpacked once."""
    version = pinned_version()
    out = _cache() / f"llama-converter-{version}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    archive = sdist()
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(prefix=".llama-converter-", dir=_cache()))
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and rel.startswith(_MEMBERS) and member.isfile():
                    member.name = rel
                    tar.extract(member, tmp, filter="data")
        try:
            tmp.rename(out)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True)
class Job:
    model_dir: str
    out: str
    outtype: str = "f32"
    pre: str | None = None  # the family's table name, used only on an unknown hash


# Runs in the child: import the converter once, convert every job.
_CHILD = r"""
import json, sys
root, jobs = sys.argv[1], json.loads(sys.stdin.read())
sys.path.insert(0, root)
import convert_hf_to_gguf as script
from conversion import base

owner = next(c for c in base.TextModel.__mro__ if "get_vocab_base_pre" in vars(c))
original = owner.get_vocab_base_pre
for job in jobs:
    def named(self, tokenizer, _pre=job["pre"]):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if _pre is None:
                raise
            return _pre
    owner.get_vocab_base_pre = named
    sys.argv = ["convert_hf_to_gguf.py", job["model_dir"], "--outfile", job["out"],
                "--outtype", job["outtype"]]
    script.main()
"""


def convert(jobs: list[Job]) -> None:
    """Run llama.cpp's converter over `jobs` in one child process (torch and transformers
    imported once); raises with the child's last words on failure."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, not the installed one
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(converter_dir())],
        input=json.dumps([asdict(j) for j in jobs]),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed: {proc.stderr[-3000:]}")

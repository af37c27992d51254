"""llama.cpp's own Hugging Face -> GGUF converter (`convert_hf_to_gguf.py` with its
`conversion/` package and `gguf-py`), from the source archive of the llama-cpp-python this
project pins: what a user's GGUF of a checkpoint is, to ingest in tests.

The archive is fetched once with pip (`pip download --no-binary`), its three converter parts
extracted under the Synapse cache dir, and reused by every later run. `SYNAPSE_LLAMA_CPP_SRC`
names an unpacked llama.cpp tree to use instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import llama_cpp
import platformdirs
from filelock import FileLock

_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _source() -> Path:
    env = os.environ.get("SYNAPSE_LLAMA_CPP_SRC")
    if env:
        return Path(env)
    version = llama_cpp.__version__
    root = Path(platformdirs.user_cache_dir("synapse")) / f"llama-cpp-converter-{version}"
    done = root / ".complete"
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if done.is_file():
            return root
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-q",
                    "-d",
                    tmp,
                    f"llama-cpp-python=={version}",
                ],
                check=True,
            )
            archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            with tarfile.open(archive) as tar:
                for member in tar.getmembers():
                    rel = member.name.removeprefix(prefix)
                    if (
                        member.name.startswith(prefix)
                        and member.isfile()
                        and rel.startswith(_PARTS)
                    ):
                        member.name = rel
                        tar.extract(member, root, filter="data")
        done.touch()
    return root


# The converter recognises a BPE pre-tokenizer by a hash of its tokenization of a fixed text,
# which only the published vocabularies match; a test's trained vocabulary (built with Qwen2's
# split rule) is told it is `qwen2`. Everything else is the converter's own code.
_DRIVER = """
import runpy, sys
from conversion import base
src, pre = sys.argv.pop(1), sys.argv.pop(1)
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model_dir: Path, out: Path, outtype: str = "f32", pre: str = "qwen2") -> Path:
    """`convert_hf_to_gguf.py model_dir --outfile out --outtype outtype`, with its own gguf-py;
    `pre`: the BPE pre-tokenizer name the trained vocabulary stands for ("" to let the
    converter decide)."""
    src = _source()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)])}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _DRIVER,
            str(src),
            pre,
            str(model_dir),
            "--outfile",
            str(out),
            "--outtype",
            outtype,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out

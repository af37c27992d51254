"""API keys (service/auth.py) and model aliases: the rules in isolation, then a REAL server
with a key file, an environment key and a config key, rotated by a real SIGHUP."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from host.errors import ConfigInvalid
from host.module import Module, ModuleConfig
from service.app import _check_aliases
from service.auth import ApiKeys, exposure_warning, is_loopback, presented_key
from service.config import ServeConfig
from tests.test_serve_support import REPO, ServerProcess, metric, server_config

FILE_KEY, ROTATED_KEY, ENV_KEY, CONFIG_KEY = "file-key-1", "file-key-2", "env-key", "cfg-key"
WRONG_KEY = "wrong-key-d41d8cd98f00b204"  # distinctive, so a leak would be found in the log
ALIAS = "text-embedding-3-small"

# ---- the rules, without a server ---------------------------------------------------------------


def test_keys_merge_config_env_and_file_and_skip_blanks_and_comments(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# operators' keys\n\n  {FILE_KEY}  \n")
    keys = ApiKeys([CONFIG_KEY], str(f), environ={"SYNAPSE_API_KEYS": f" {ENV_KEY} ,, "})
    assert len(keys) == 3
    for good in (FILE_KEY, ENV_KEY, CONFIG_KEY):
        assert keys.accepts(good)
    for bad in ("", "# operators' keys", FILE_KEY[:-1], FILE_KEY + "x", WRONG_KEY):
        assert not keys.accepts(bad)
    assert not ApiKeys([], environ={}).enabled


def test_a_key_file_that_is_missing_or_empty_refuses_to_start(tmp_path):
    with pytest.raises(ConfigInvalid, match="cannot read") as info:
        ApiKeys([], str(tmp_path / "absent"), environ={})
    assert "absent" in info.value.message
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigInvalid, match="holds no key"):
        ApiKeys([], str(empty), environ={})


def test_reload_rotates_but_never_opens_the_server(tmp_path):
    f = tmp_path / "keys"
    f.write_text(FILE_KEY)
    keys = ApiKeys([], str(f), environ={})
    f.write_text(ROTATED_KEY)
    assert keys.reload() and keys.accepts(ROTATED_KEY) and not keys.accepts(FILE_KEY)
    f.write_text("")  # emptied: keeps the old keys rather than serving everyone
    assert not keys.reload() and keys.accepts(ROTATED_KEY)
    f.unlink()  # unreadable: same
    assert not keys.reload() and keys.accepts(ROTATED_KEY)


def test_an_emptied_file_keeps_its_keys_even_beside_other_sources(tmp_path):
    # Caught mid-rewrite by SIGHUP, an empty file must not revoke the keys clients use.
    f = tmp_path / "keys"
    f.write_text(FILE_KEY)
    keys = ApiKeys([CONFIG_KEY], str(f), environ={"SYNAPSE_API_KEYS": ENV_KEY})
    f.write_text("# rotating\n")
    assert not keys.reload()
    assert keys.accepts(FILE_KEY) and keys.accepts(CONFIG_KEY) and keys.accepts(ENV_KEY)


def test_a_key_file_with_a_byte_order_mark_serves_its_first_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{FILE_KEY}\n{ROTATED_KEY}\n", encoding="utf-8-sig")  # as PowerShell writes
    keys = ApiKeys([], str(f), environ={})
    assert keys.accepts(FILE_KEY) and keys.accepts(ROTATED_KEY) and len(keys) == 2


def test_presented_key_reads_bearer_then_x_api_key():
    assert presented_key({b"authorization": b"Bearer abc"}) == "abc"
    assert presented_key({b"authorization": b"bearer  abc "}) == "abc"
    assert presented_key({b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Basic Zm9v", b"x-api-key": b"xyz"}) == "xyz"
    assert presented_key({b"authorization": b"Bearer "}) is None
    assert presented_key({}) is None


def test_open_server_on_a_non_loopback_address_is_warned_about():
    none = ApiKeys([], environ={})
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example")
    assert exposure_warning("127.0.0.1", none) is None
    assert exposure_warning("0.0.0.0", ApiKeys(["k"], environ={})) is None
    warning = exposure_warning("0.0.0.0", none)
    assert warning is not None and "\n" not in warning and "0.0.0.0" in warning


def test_config_refuses_alias_chains_and_empty_keys():
    with pytest.raises(ConfigInvalid, match="itself an alias"):
        ServeConfig(aliases={"a": "b", "b": "minilm-l6-v2"})
    with pytest.raises(ConfigInvalid, match="itself an alias"):
        ServeConfig(aliases={"a": "a"})
    with pytest.raises(ConfigInvalid, match="empty"):
        ServeConfig(api_keys=[" "])


@pytest.mark.model
def test_an_alias_may_not_hide_an_installed_model(store_root):
    module = Module(ModuleConfig(store_root=store_root))  # starts no worker
    with pytest.raises(ConfigInvalid, match="name of an installed model"):
        _check_aliases(ServeConfig(aliases={"minilm-l6-v2": "gemma3-270m"}), module)
    _check_aliases(ServeConfig(aliases={ALIAS: "minilm-l6-v2"}), module)


def test_serve_with_an_unreadable_key_file_exits_2_before_binding(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "service", "--api-key-file", str(tmp_path / "absent")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error[config_invalid]" in proc.stderr and "listening" not in proc.stdout


# ---- a real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(store_root):
    key_dir = Path(tempfile.mkdtemp(prefix="syn-keys-", dir="/tmp"))
    key_file = key_dir / "keys"
    key_file.write_text(f"{FILE_KEY}\n")
    cfg = server_config(
        store_root,
        preload=["minilm-l6-v2"],
        api_keys=[CONFIG_KEY],
        metrics_require_key=True,
        aliases={ALIAS: "minilm-l6-v2"},
    )
    srv = ServerProcess(
        cfg, args=["--api-key-file", str(key_file)], env={"SYNAPSE_API_KEYS": ENV_KEY}
    )
    srv.key_file = key_file
    yield srv
    srv.stop()
    shutil.rmtree(key_dir, ignore_errors=True)


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _assert_401(resp: httpx.Response) -> dict:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert err["message"] and err["param"] is None
    return err


@pytest.mark.model
def test_missing_or_wrong_key_is_401_and_the_key_goes_nowhere(server):
    url = server.url
    before = httpx.get(f"{url}/metrics", headers=_bearer(FILE_KEY)).text
    missing0 = metric(before, "synapse_auth_failures_total", reason="missing") or 0
    invalid0 = metric(before, "synapse_auth_failures_total", reason="invalid") or 0

    body = {"input": "x"}
    err = _assert_401(httpx.post(f"{url}/v1/embeddings", json=body))
    assert "Bearer" in err["message"]
    for headers in (_bearer(WRONG_KEY), {"x-api-key": WRONG_KEY}):
        err = _assert_401(httpx.post(f"{url}/v1/embeddings", json=body, headers=headers))
        assert WRONG_KEY not in err["message"]
    _assert_401(httpx.get(f"{url}/v2/unknown-path"))  # no route map for strangers
    _assert_401(httpx.get(f"{url}/metrics"))  # metrics_require_key = true

    after = httpx.get(f"{url}/metrics", headers={"x-api-key": ENV_KEY}).text
    assert metric(after, "synapse_auth_failures_total", reason="missing") == missing0 + 3
    assert metric(after, "synapse_auth_failures_total", reason="invalid") == invalid0 + 2
    assert metric(after, "synapse_http_requests_total", endpoint="/v1/embeddings", status="401")
    for secret in (WRONG_KEY, FILE_KEY, ENV_KEY, CONFIG_KEY):
        assert secret not in after and secret not in server.log()


@pytest.mark.model
def test_each_key_source_and_both_headers_are_accepted(server):
    for key in (FILE_KEY, ENV_KEY, CONFIG_KEY):
        for headers in (_bearer(key), {"x-api-key": key}):
            resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, headers=headers)
            assert resp.status_code == 200, resp.text


@pytest.mark.model
def test_health_and_the_document_stay_open(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert not any("WARNING" in line for line in server.log().splitlines())  # loopback
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert doc["security"] == [{"bearerAuth": []}, {"apiKeyHeader": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/metrics"]["get"]  # protected on this server


@pytest.mark.model
def test_openai_client_with_a_key_and_its_usual_model_name(server):
    import openai  # here: its import costs the fast loop, which collects this module

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=FILE_KEY, max_retries=0)
    by_alias = client.embeddings.create(input=["a cat"], model=ALIAS)
    direct = client.embeddings.create(input=["a cat"], model="minilm-l6-v2")
    assert np.array_equal(by_alias.data[0].embedding, direct.data[0].embedding)
    assert by_alias.model == "minilm-l6-v2"  # the response names the model that ran

    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.embeddings.create(input=["a cat"], model=ALIAS)
    assert info.value.body["code"] == "invalid_api_key"


@pytest.mark.model
def test_aliases_are_listed_and_unknown_names_list_what_exists(server):
    h = _bearer(FILE_KEY)
    models = httpx.get(f"{server.url}/v1/models", headers=h).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id[ALIAS]["alias_for"] == "minilm-l6-v2"
    assert by_id[ALIAS]["dims"] == by_id["minilm-l6-v2"]["dims"] == 384
    assert "alias_for" not in by_id["minilm-l6-v2"]
    one = httpx.get(f"{server.url}/v1/models/{ALIAS}", headers=h).json()
    assert one["alias_for"] == "minilm-l6-v2" and one["loaded"]

    resp = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": "x", "model": "gpt-nope"}, headers=h
    )
    err = resp.json()["error"]
    assert resp.status_code == 404 and err["code"] == "model_not_found"
    assert "gpt-nope" in err["message"]
    assert "minilm-l6-v2" in err["message"] and ALIAS in err["message"]
    rerank = httpx.post(
        f"{server.url}/v1/rerank",
        json={"model": ALIAS, "query": "cats", "documents": ["a cat", "stocks"]},
        headers=h,
    )
    assert rerank.status_code == 200 and rerank.json()["results"][0]["index"] == 0


@pytest.mark.model
def test_sighup_rotates_the_key_file_without_a_restart(server):
    pid = server.worker_pid()
    mark = len(server.lines)
    server.key_file.write_text(f"# rotated\n{ROTATED_KEY}\n")
    server.proc.send_signal(signal.SIGHUP)
    assert "reloaded (3 keys)" in server.wait_for_line("API keys", after=mark)
    embed = f"{server.url}/v1/embeddings"
    _assert_401(httpx.post(embed, json={"input": "x"}, headers=_bearer(FILE_KEY)))
    assert httpx.post(embed, json={"input": "x"}, headers=_bearer(ROTATED_KEY)).status_code == 200
    assert httpx.post(embed, json={"input": "x"}, headers=_bearer(ENV_KEY)).status_code == 200

    mark = len(server.lines)
    server.key_file.unlink()  # unreadable: the rotated key stays, and the operator is told
    server.proc.send_signal(signal.SIGHUP)
    assert "NOT reloaded" in server.wait_for_line("API keys", after=mark)
    assert httpx.post(embed, json={"input": "x"}, headers=_bearer(ROTATED_KEY)).status_code == 200
    assert server.proc.poll() is None and server.worker_pid() == pid  # same server, same worker

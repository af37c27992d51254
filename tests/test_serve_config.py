"""Server configuration files (TOML and JSON onto ServeConfig) and the CLI's handling of them."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from host.errors import ConfigInvalid
from service.config import ServeConfig, load_config


def test_defaults_bind_loopback():
    cfg = load_config(None)
    assert cfg.host == "127.0.0.1" and cfg.port == 8080
    assert cfg.matryoshka_models == [] and cfg.preload == ["minilm-l6-v2"]


def test_toml_and_json_map_onto_module_and_scheduler_settings(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text(
        'port = 9001\nmatryoshka_models = ["m"]\n'
        "[module]\nmax_generate_tokens = 32\n[module.host]\nquarantine_s = 5.0\n"
        "[module.budgets]\nmax_inputs = 100\n"
        "[scheduler]\nmax_wait_ms = 1.5\nmax_batch_tokens = 1024\n"
    )
    cfg = load_config(toml)
    assert cfg.port == 9001 and cfg.matryoshka_models == ["m"]
    assert cfg.module.max_generate_tokens == 32 and cfg.module.host.quarantine_s == 5.0
    assert cfg.module.budgets.max_inputs == 100
    assert cfg.scheduler.max_wait_ms == 1.5 and cfg.scheduler.max_batch_tokens == 1024

    js = tmp_path / "serve.json"
    js.write_text('{"host": "::1", "scheduler": {"max_queue_items": 5000}}')
    cfg = load_config(js)
    assert cfg.host == "::1" and cfg.scheduler.max_queue_items == 5000


@pytest.mark.parametrize(
    "text, match",
    [
        ("prot = 1\n", "prot"),  # a typo is an error, not a silent default
        ('port = "x"\n', "port"),
        ("port = 70000\n", "port"),
        ("[scheduler]\nmax_batch_items = 0\n", "max_batch_items"),
        ("[scheduler]\nmax_queue_items = 10\n", "max_queue_items"),
        ("this is not toml", "config"),
        # NaN passes `x < 0` and `x <= 0` checks: each number is checked so that it fails.
        ("[scheduler]\nrequest_timeout_s = nan\n", "request_timeout_s"),
        ("[scheduler]\nmax_wait_ms = nan\n", "max_wait_ms"),
        ("[scheduler]\nrequest_timeout_s = inf\n", "request_timeout_s"),
        ("body_timeout_s = nan\n", "body_timeout_s"),
        ("graceful_timeout_s = -5.0\n", "graceful_timeout_s"),
        ("default_completion_tokens = 0\n", "default_completion_tokens"),
        ("default_completion_tokens = 100\n", "default_completion_tokens"),  # over 64
        ("[module]\nmax_worker_batch_tokens = 0\n", "max_worker_batch_tokens"),
        ("[module]\nmax_generate_tokens = 0\n", "max_generate_tokens"),
        ("[module.budgets]\nmax_inflight_tokens = 0\n", "max_inflight_tokens"),
        ("[module.budgets]\nmax_inputs = -1\n", "max_inputs"),
    ],
)
def test_bad_configs_are_config_invalid(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigInvalid, match=match):
        load_config(path)
    with pytest.raises(ConfigInvalid, match="cannot read"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "name, text",
    [
        ("serve.toml", "[module]\nmax_batch_tokens = 4096\n"),
        ("serve.json", '{"module": {"max_batch_tokens": 4096}}'),
    ],
)
def test_the_module_s_old_batch_key_is_refused_with_its_new_name(tmp_path, name, text):
    # One name used to mean two sizes: the module's old spelling is refused, never read as
    # either of them; the scheduler's keeps its name (TEI's).
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigInvalid) as e:
        load_config(path)
    assert "renamed max_worker_batch_tokens" in str(e.value)
    assert "[scheduler] max_batch_tokens" in str(e.value)
    if name.endswith(".json"):
        path.write_text(
            '{"module": {"max_worker_batch_tokens": 1000}, "scheduler": {"max_batch_tokens": 300}}'
        )
    else:
        path.write_text(
            "[module]\nmax_worker_batch_tokens = 1000\n[scheduler]\nmax_batch_tokens = 300\n"
        )
    cfg = load_config(path)
    assert cfg.module.max_worker_batch_tokens == 1000 and cfg.scheduler.max_batch_tokens == 300


def test_other_unknown_keys_keep_msgspec_s_message(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("[module]\nmax_batch_tokenz = 1\n")
    with pytest.raises(ConfigInvalid, match="max_batch_tokenz") as e:
        load_config(path)
    assert "renamed" not in str(e.value)


def test_cli_reports_a_bad_config_and_exits_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"port": -1}')
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "error[config_invalid]" in proc.stderr, proc.stderr
    assert ServeConfig().port == 8080


def test_matryoshka_models_may_be_named_by_alias():
    cfg = ServeConfig(aliases={"small": "nomic"}, matryoshka_models=["small", "other"])
    assert cfg.matryoshka_models == ["nomic", "other"]  # requests are matched after resolution


def test_the_default_completion_length_follows_a_lower_generation_limit():
    assert ServeConfig().default_completion_tokens == 16  # OpenAI's default
    low = msgspec.convert({"module": {"max_generate_tokens": 4}}, ServeConfig)
    assert low.default_completion_tokens == 4  # not a config error, not 16


def test_model_key_is_preloaded_first_and_alone_unless_preload_names_others():
    assert load_config(None).default_model == "minilm-l6-v2"
    cfg = ServeConfig(model="acme/embed")
    assert cfg.preload == ["acme/embed"] and cfg.default_model == "acme/embed"
    assert ServeConfig(model="m", preload=["r"]).preload == ["m", "r"]
    assert ServeConfig(model="m", preload=["r", "m"]).preload == ["r", "m"]
    with pytest.raises(ConfigInvalid, match="model: name a model"):
        ServeConfig(model=" ")

"""Server configuration: one msgspec struct, read from a TOML or JSON file.

The file maps onto `ServeConfig`; its `module` table is the host's `ModuleConfig` (store,
budgets, lane windows) and its `scheduler` table the batching/backpressure settings. Unknown
keys at the top level are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from host.errors import ConfigInvalid
from host.module import ModuleConfig, check_lane_list
from host.residency import ResidencyConfig
from ingest.store import DEFAULT_EMBED
from service.ray_settings import RaySettings
from service.scheduler import SchedulerConfig


class ModelSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One model's serving settings (`[models."NAME"]`)."""

    # "auto": every lane certified for this machine (two agreeing lanes are routed between).
    # A list: those lanes (["ane", "llama"]: both, certified or not, once their vectors
    # agree on the certification corpus; ["llama"]: that lane alone).
    lanes: Literal["auto"] | list[str] = "auto"


class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8080
    module: ModuleConfig = msgspec.field(default_factory=ModuleConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    # The model a request that names none is served by, loaded at start: a store name or a
    # Hugging Face repository id ("BAAI/bge-m3", pulled at start when missing, as TEI's and
    # Infinity's `--model-id`). Unset: the default embedder.
    model: str | None = None
    # Models loaded at start. Unwritten: `model` alone when it is set (a server named for one
    # model does not also load the default embedder), else the default embedder; `model` is
    # always among them, first.
    preload: list[str] | None = None
    install_defaults: bool = True  # ingest the embedded default models at start (idempotent)
    # Models whose embeddings may be truncated with `dimensions` (Matryoshka-trained), beside
    # those whose manifest has `matryoshka_dims`. MiniLM is neither: truncating it loses
    # quality silently, so it is refused unless listed here.
    matryoshka_models: list[str] = []
    max_body_bytes: int = 4 << 20  # -> 413 above this
    graceful_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may drain
    # max_tokens when a completion request omits it; default: OpenAI's 16, or
    # module.max_generate_tokens where that is lower.
    default_completion_tokens: int | None = None
    # A client that stops sending its body mid-way gets a 408 after this long, instead of
    # holding a connection and a task forever.
    body_timeout_s: float = 30.0
    # API keys (service/auth.py). Also from `--api-key-file` and SYNAPSE_API_KEYS; never
    # from a command-line argument, which any local user can read in `ps`.
    api_keys: list[str] = []
    api_key_file: str | None = None
    metrics_require_key: bool = False  # /metrics is open by default (scrapers), /health always
    # Names clients send (e.g. OpenAI's) -> installed models: {"text-embedding-3-small" =
    # "minilm-l6-v2"}. Listed by /v1/models; one level only (an alias never names an alias).
    aliases: dict[str, str] = {}
    ray: RaySettings = msgspec.field(default_factory=RaySettings)  # `serve --ray` only
    # Idle keep-alive and memory budget of the loaded models (host/residency.py).
    residency: ResidencyConfig = msgspec.field(default_factory=ResidencyConfig)
    # Per model (aliases allowed): which lanes serve it (ModelSettings).
    models: dict[str, ModelSettings] = {}

    @property
    def default_model(self) -> str:
        """What a request that names no model gets."""
        return self.model or DEFAULT_EMBED

    @property
    def preloaded(self) -> list[str]:
        return self.preload or []

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigInvalid(f"port {self.port} out of range")
        if self.max_body_bytes < 1024:
            raise ConfigInvalid("max_body_bytes must be >= 1024")
        if self.scheduler.max_queue_items < self.module.budgets.max_inputs:
            raise ConfigInvalid(
                "scheduler.max_queue_items must be >= module.budgets.max_inputs, or a "
                "maximal request could never be queued"
            )
        # Written so that NaN fails too (every comparison with NaN is false).
        if not 0 < self.body_timeout_s < math.inf:
            raise ConfigInvalid("body_timeout_s must be finite and > 0")
        if not 0 <= self.graceful_timeout_s < math.inf:
            raise ConfigInvalid("graceful_timeout_s must be finite and >= 0")
        if self.default_completion_tokens is None:
            self.default_completion_tokens = min(16, self.module.max_generate_tokens)
        if not 1 <= self.default_completion_tokens <= self.module.max_generate_tokens:
            raise ConfigInvalid(
                f"default_completion_tokens must be 1..module.max_generate_tokens "
                f"({self.module.max_generate_tokens}), or every completion that omits "
                "max_tokens would be refused"
            )
        if any(not k.strip() for k in self.api_keys):
            raise ConfigInvalid("api_keys: a key must not be empty")
        for alias, target in self.aliases.items():
            if not alias or not target:
                raise ConfigInvalid("aliases: names and targets must not be empty")
            if target in self.aliases:
                raise ConfigInvalid(
                    f"aliases: {alias!r} -> {target!r}, which is itself an alias; name the "
                    "installed model directly"
                )
        if self.model is not None and not self.model.strip():
            raise ConfigInvalid("model: name a model (a store name or ORG/NAME), or leave it out")
        if self.preload is None:
            self.preload = [self.model or DEFAULT_EMBED]
        elif self.model is not None and self.model not in self.preload:
            self.preload = [self.model, *self.preload]
        # Requests are matched after alias resolution: list the model an alias names.
        self.matryoshka_models = [self.aliases.get(m, m) for m in self.matryoshka_models]
        self.residency = self.residency.resolved(self.aliases)
        lanes = dict(self.module.model_lanes)
        for name, settings in self.models.items():
            if settings.lanes != "auto":
                model = self.aliases.get(name, name)
                lanes[model] = check_lane_list(model, list(settings.lanes))
        self.module.model_lanes = lanes


# Keys a serve.toml may no longer spell the old way: `max_batch_tokens` named two different
# sizes, the scheduler's coalesced batch (kept) and the module's request to one worker
# (renamed). The old module key is refused rather than read as the new one, so that a file
# written with either meaning in mind is looked at once instead of silently changing size.
RENAMED_KEYS = {
    ("module", "max_batch_tokens"): (
        "[module] max_batch_tokens was renamed max_worker_batch_tokens (token ids per "
        "EMBED_BATCH or RERANK request the host sends one worker); the coalescing "
        "scheduler's batch size is still [scheduler] max_batch_tokens"
    ),
}


def renamed_key(raw: object) -> str | None:
    """The refusal for the first renamed key `raw` (a decoded config file) still uses."""
    for (table, key), reason in RENAMED_KEYS.items():
        section = raw.get(table) if isinstance(raw, dict) else None
        if isinstance(section, dict) and key in section:
            return reason
    return None


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigInvalid(f"cannot read config {p}: {exc}") from None
    try:
        if p.suffix.lower() == ".json":
            return msgspec.json.decode(data, type=ServeConfig)
        return msgspec.toml.decode(data, type=ServeConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        reason = _renamed_key_in(data, json_file=p.suffix.lower() == ".json")
        raise ConfigInvalid(f"config {p}: {reason or exc}") from None


def _renamed_key_in(data: bytes, json_file: bool) -> str | None:
    try:
        raw = json.loads(data) if json_file else tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None  # not a readable file at all: msgspec's own error says where
    return renamed_key(raw)


def install_defaults(config: ServeConfig) -> ServeConfig:
    """Install the embedded default models once, before any app starts (not in every app's
    lifespan or Ray replica); the config handed on no longer asks for it. Raises the store's
    typed error (a full disk: storage_full)."""
    if not config.install_defaults:
        return config
    from ingest.defaults import ensure_defaults

    ensure_defaults(config.module.store_root)
    return msgspec.structs.replace(config, install_defaults=False)

"""What every handler shares: config, keys, module, scheduler, metrics, and the draining flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from common.errors import InvalidRequest, ModelNotFound, SynapseError
from host.errors import ConfigInvalid
from host.module import Module
from service import disconnect
from service.auth import ApiKeys
from service.body import read_json
from service.config import ServeConfig
from service.metrics import Metrics
from service.scheduler import Scheduler

T = TypeVar("T")


@dataclass
class ServerState:
    config: ServeConfig
    module: Module | None = None
    scheduler: Scheduler | None = None
    draining: bool = False
    metrics: Metrics = field(init=False)
    keys: ApiKeys = field(init=False)
    disconnects: disconnect.Watches = field(default_factory=disconnect.Watches)
    _known: set[str] = field(default_factory=set)
    _openapi: tuple[bool, bytes] | None = None  # (auth enabled, encoded document)

    def __post_init__(self) -> None:
        self.metrics = Metrics(lambda: self.module, lambda: self.scheduler)
        # Raises ConfigInvalid when the key file cannot be read: the server must not start
        # open because a file it was told to use is missing.
        self.keys = ApiKeys(self.config.api_keys, self.config.api_key_file)

    async def read_json(self, request: Request, type_: type[T]) -> T:
        """The request's body under the configured size and time limits, as `type_`; from here
        on, the client closing its connection cancels the request (service/disconnect.py)."""
        cfg = self.config
        body = await read_json(request, type_, cfg.max_body_bytes, cfg.body_timeout_s)
        self.disconnects.watch(request)
        return body

    def resolve(self, name: str | None, default: str) -> str:
        """The installed model a request names (directly or by alias), or a 404 before any
        lane is touched.

        A name the store rejects as malformed is also a 404 (not the module's 500): to a
        client it is simply a model that does not exist.
        """
        model = name or default
        model = self.config.aliases.get(model, model)
        if model in self._known:
            return model
        assert self.module is not None
        try:
            self.module.store.get(model)
        except (ModelNotFound, InvalidRequest):
            raise ModelNotFound(
                f"model {name or default!r} does not exist; available: "
                f"{', '.join(self.available_names())}",
                param="model",
            ) from None
        except SynapseError as exc:  # installed but damaged: the operator's problem
            raise ConfigInvalid(f"model {model!r}: {exc.message}") from None
        self._known.add(model)
        return model

    def available_names(self) -> list[str]:
        """Installed models, then aliases: what a 404 tells the client it may ask for."""
        assert self.module is not None
        return sorted(r.name for r in self.module.store.ls()) + sorted(self.config.aliases)

"""What every handler shares: config, module, scheduler, metrics, and the draining flag."""

from __future__ import annotations

from dataclasses import dataclass, field

from host.artifacts.errors import ArtifactError, ArtifactNotFound
from host.artifacts.errors import InvalidRequest as BadName
from host.errors import ConfigInvalid, ModelNotFound
from host.metrics import Metrics
from host.module import Module
from host.scheduler import Scheduler
from host.serve.config import ServeConfig


@dataclass
class ServerState:
    config: ServeConfig
    module: Module | None = None
    scheduler: Scheduler | None = None
    draining: bool = False
    metrics: Metrics = field(init=False)
    _known: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.metrics = Metrics(lambda: self.module, lambda: self.scheduler)

    def resolve(self, name: str | None, default: str) -> str:
        """The model a request names, or a 404 before any lane is touched.

        A name the store rejects as malformed is also a 404 (not the module's 500): to a
        client it is simply a model that does not exist.
        """
        model = name or default
        if model in self._known:
            return model
        assert self.module is not None
        try:
            self.module.store.get(model)
        except (ArtifactNotFound, BadName):
            raise ModelNotFound(
                f"model {model!r} does not exist; GET /v1/models lists the installed ones",
                param="model",
            ) from None
        except ArtifactError as exc:  # installed but damaged: the operator's problem
            raise ConfigInvalid(f"model {model!r}: {exc.msg}") from None
        self._known.add(model)
        return model

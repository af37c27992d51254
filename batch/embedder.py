"""One lane's share of a job: embed token-id batches through a `Module`, surviving crashes.

Crash policy (the lane's supervisor already kills, reaps and replaces a crashed worker):
- a batch whose worker dies is retried once, whole: a lost worker is usually not the rows'
  fault (a SIGKILL, an OOM kill);
- if it crashes again, each of its rows runs alone, at most twice: a row that crashes the
  engine twice is reported as `engine_crashed` and the job goes on without it;
- the lane quarantines after two consecutive crashes (a service's protection). The job lifts
  it before each attempt instead, because its own budget bounds the crashes: more than
  `crash_budget` crashes in a row without one success aborts the job (`JobAborted`), so an
  engine that cannot run at all never loops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batch.errors import JobAborted
from host.errors import EngineCrashed
from host.lane import Lane
from host.module import Module
from host.tokenization import Tokenizer
from ingest.store import DEFAULT_EMBED

log = logging.getLogger("synapse.batch")


@dataclass
class BatchResult:
    # float32 (n, dims), rows in `failed` zeros; with `outputs`, per input a dict kind ->
    # its output (host.token_outputs), None in `failed`
    vectors: Any
    failed: dict[int, str] = field(default_factory=dict)  # batch index -> error message


class LaneEmbedder:
    def __init__(
        self,
        module: Module,
        model: str | None,
        lane: str | None,
        normalize: bool = True,
        runtime_config: dict | None = None,
        crash_budget: int = 8,
        prompt_name: str | None = None,
        task: str = "embed",
        outputs: Sequence[str] = (),
    ) -> None:
        self.module = module
        # Token-level outputs (Module.encode_token_ids) instead of pooled vectors: each input
        # gives a dict kind -> output. Empty: vectors, as `embed_token_ids` returns them.
        self.outputs = tuple(outputs)
        # "embed": rows -> vectors; "classify": rows -> a sequence classifier's raw logits,
        # one per label (`dims` is then the label count), on the llama lane.
        self.task = task
        self.model = model or DEFAULT_EMBED
        self.prompt_name = prompt_name  # None: the model's default prompt, if it has one
        self.prompt = ""  # the text prepended to every row, known once started
        self.requested_lane = lane  # None: the module's own default/auto choice
        self.normalize = normalize
        self.runtime_config = runtime_config
        self.crash_budget = crash_budget
        self.crashes_in_a_row = 0
        self.crashes = 0
        self.lane = ""  # the lane kind actually serving ("llama", "ane")
        self.rows = 0  # rows this lane embedded (a job on two lanes reports each one's share)
        self.tokenizer: Tokenizer | None = None
        self.dims = 0

    async def start(self) -> None:
        """Load the model (its lane starts a supervised worker) and learn what serves it:
        the requested lane, else llama.cpp for runtime settings (they are LOAD extras of an
        explicit lane), else the lane the Module's policy chooses."""
        if self.task == "classify":
            self.lane = "llama"  # the lane with a classifier head of any width
        elif self.requested_lane is not None:
            self.lane = self.requested_lane
        elif self.runtime_config:
            self.lane = "llama"
        else:
            self.lane = (await self.module.load_default_lane(self.model)).lane
        if self.runtime_config:
            await self.module.load(self.model, self.lane, self.runtime_config)
        self.tokenizer = await self.module.tokenizer(self.model, lane=self.lane)
        if self.task == "classify":
            self.dims = len(self.module.labels(self.model))
            return
        self.prompt = self.module.prompt(self.model, self.prompt_name)
        self.dims = self.module.dims(self.model, self.lane)

    @property
    def supervisor(self) -> Lane:
        """The supervisor of the worker serving this share of the job."""
        lane = self.module.supervisor(self.model, self.lane)
        if lane is None:
            raise JobAborted(f"{self.model} is no longer loaded on the {self.lane} lane")
        return lane

    @property
    def worker_pid(self) -> int | None:
        return self.supervisor.state().pid

    def identity(self) -> dict:
        return self.module.lane_identity(self.model, self.lane)

    async def embed(self, ids: list[np.ndarray]) -> BatchResult:
        try:
            return BatchResult(await self._attempt(ids))
        except EngineCrashed as exc:
            log.warning("batch of %d rows: %s; retrying it", len(ids), exc.message)
        try:
            return BatchResult(await self._attempt(ids))
        except EngineCrashed as exc:
            if len(ids) == 1:
                return BatchResult(self._zeros(1), {0: _crash_message(exc)})
            log.warning("batch of %d rows crashed twice; running its rows alone", len(ids))
        out, failed = self._zeros(len(ids)), {}
        for i, row in enumerate(ids):
            for attempt in (1, 2):
                try:
                    out[i] = (await self._attempt([row]))[0]
                    break
                except EngineCrashed as exc:
                    if attempt == 2:
                        failed[i] = _crash_message(exc)
        return BatchResult(out, failed)

    async def _attempt(self, ids: list[np.ndarray]) -> Any:
        lane = self.supervisor
        if lane.state().quarantined:
            lane.clear_quarantine()  # our crash budget, not the lane's, decides (see above)
        try:
            if self.task == "classify":
                vectors = (await self.module.classify_token_ids(ids, self.model)).logits
            elif self.outputs:
                got = await self.module.encode_token_ids(
                    ids, self.outputs, self.model, normalize=self.normalize, lane=self.lane
                )
                vectors = [{k: got[k][i] for k in self.outputs} for i in range(len(ids))]
            else:
                vectors = await self.module.embed_token_ids(
                    ids, self.model, normalize=self.normalize, lane=self.lane
                )
        except EngineCrashed as exc:
            self.crashes += 1
            self.crashes_in_a_row += 1
            if self.crashes_in_a_row > self.crash_budget:
                raise JobAborted(
                    f"the {self.lane} engine crashed {self.crashes_in_a_row} times in a row "
                    f"without one success; last: {exc.message}"
                ) from exc
            raise
        self.crashes_in_a_row = 0
        self.rows += len(ids)
        return vectors

    def _zeros(self, n: int) -> Any:
        if self.outputs:
            return [None] * n
        return np.zeros((n, self.dims), dtype=np.float32)


def _crash_message(exc: EngineCrashed) -> str:
    tail = exc.log_tail.strip().splitlines()[-1:] if exc.log_tail else []
    last = f" (worker's last words: {tail[0][:200]})" if tail else ""
    return f"this row crashed the engine twice: {exc.message}{last}"

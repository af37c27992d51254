"""Embedding models served by the REAL fault-injection worker (workers.faulty) through a REAL
`host.lane.Lane`, tokenized by MiniLM's real tokenizer: what `service.scheduler.Scheduler`
needs of its models (`EmbeddingModels`), with no model built or loaded. The worker answers
every input with [sum(ids), n_tokens, first id, item id], so a row says which input it is.

`frozen(models)` stops the worker process (SIGSTOP) until the block ends (SIGCONT): a request
sent meanwhile stays on the wire and the lane busy for as long as the test says, so a test
queues work behind a batch without depending on how long the batch takes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import psutil

from common.errors import InvalidRequest, ModelNotFound
from host.admission import Admission, Budgets
from host.config import HostConfig, LaneConfig
from host.lane import Lane
from host.tokenization import Tokenizer
from ingest.model_packages import minilm_dir
from workers.protocol import messages as m

MODEL = "minilm-l6-v2"  # served by the faulty worker under MiniLM's tokenizer
GENERATOR = "a-generate-model"  # known, but not an embedding model
WORKER = ["python", "-m", "workers.faulty"]


@dataclass(frozen=True)
class Described:
    name: str
    kind: str


class FaultyModels:
    """`MODEL` loaded into one faulty worker (its LOAD names `n_vocab` when given: the worker
    then refuses ids outside it); `GENERATOR` is known and never loaded."""

    def __init__(
        self, *, budgets: Budgets | None = None, n_vocab: int | None = None, **host
    ) -> None:
        self.admission = Admission(budgets or Budgets())
        self.kinds = {MODEL: "embed", GENERATOR: "generate"}
        self.n_vocab = n_vocab
        self._tokenizer = Tokenizer.from_model_dir(minilm_dir())
        self.runtime_dir = tempfile.mkdtemp(prefix="syn-", dir="/tmp")
        # A stopped worker is a silent one: the watchdog ends a test that never thaws it.
        host = {"ping_interval_s": 0, "inference_window_s": 30.0, **host}
        self.lane = Lane(
            LaneConfig(lane_id="faulty", argv=WORKER),
            HostConfig(runtime_dir=self.runtime_dir, **host),
        )

    async def __aenter__(self) -> FaultyModels:
        try:
            await self.lane.start()
            extra = {} if self.n_vocab is None else {"n_vocab": self.n_vocab}
            load = m.LOAD(  # the faulty worker reads no artifact
                req_id=0,
                artifact_path="-",
                artifact_digest="-",
                format="faulty",
                runtime_config={"model_ref": MODEL, **extra},
            )
            await self.lane.request(load)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.lane.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ---- what the scheduler uses (service.scheduler.EmbeddingModels) ----------------------

    def record(self, name: str) -> Described:
        kind = self.kinds.get(name)
        if kind is None:
            raise ModelNotFound(f"model {name!r} is not installed", model=name)
        return Described(name, kind)

    def prompt(
        self, model: str | None = None, prompt_name: str | None = None, prompt: str | None = None
    ) -> str:
        if prompt_name is not None:
            raise InvalidRequest(f"model {model!r} has no prompt named {prompt_name!r}")
        return prompt or ""

    async def tokenizer(self, model: str | None = None) -> Tokenizer:
        self.record(model or MODEL)
        return self._tokenizer

    async def embed_token_ids(
        self,
        ids: list[np.ndarray],
        model: str | None = None,
        normalize: bool = True,
        lane: str | None = None,
    ) -> np.ndarray:
        req = m.EMBED_BATCH(
            req_id=0,
            model_ref=model or MODEL,
            normalize=normalize,
            items=[m.EmbedItem(id=i, n_tokens=len(x)) for i, x in enumerate(ids)],
        )
        _, vectors = await self.lane.request(req, np.concatenate(ids))
        assert vectors is not None
        return vectors

    def supervisor(self, name: str) -> Lane | None:
        return self.lane if name == MODEL else None

    def pick_lane(self, name: str, items: int, *, longest: int = 0) -> str | None:
        return "llama"

    def serving_lanes(self, name: str) -> tuple[str, ...]:
        return ("llama",)

    # ---- for the tests ----------------------------------------------------------------------

    def rows(self, texts: list[str], truncate: bool = True) -> np.ndarray:
        """What the worker answers for `texts` as the tokenizer encodes them, item id left
        out: [sum(ids), n_tokens, first id] each."""
        encoded = self._tokenizer.encode(texts, truncate)
        return np.array([[x.sum(), len(x), x[0]] for x in encoded.ids], dtype=np.float32)


def freeze(pid: int) -> None:
    """Stop the worker process: once `kill` returns the stop is pending, and the worker runs
    no more of its own code; waiting for the stopped state says so explicitly."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.001)


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def frozen(models: FaultyModels) -> Iterator[int]:
    """The worker stopped for the block (its pid yielded), running again after it."""
    pid = models.lane.state().pid
    assert pid is not None, "no live worker to freeze"
    freeze(pid)
    try:
        yield pid
    finally:
        thaw(pid)

"""`python -m workers.faulty --socket PATH --nonce NONCE [--fault NAME] [--import-s SECS
[--import-at-start]]`

`--import-s SECS` gives the engine a library whose import takes SECS (`slow_library`): imported
lazily by LOAD (with PROGRESS after it), or before HELLO with `--import-at-start`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from workers import runtime
from workers.faulty.engine import FaultEngine
from workers.protocol import messages as m
from workers.protocol.framing import encode_frame


class FaultRuntime(runtime.WorkerRuntime):
    fault: str | None = None

    def hello_message(self) -> m.HELLO:
        hello = super().hello_message()
        if self.fault == "wrong_nonce":
            return m.HELLO(**{**_fields(hello), "nonce": "not-the-nonce"})
        if self.fault == "v2":
            return m.HELLO(**{**_fields(hello), "v": 2})
        if self.fault == "no_hello":
            time.sleep(3600)
        if self.fault == "early_progress":  # something other than HELLO comes first
            return m.PROGRESS(req_id=0, completed=1, phase="setup")  # type: ignore[return-value]
        if self.fault == "hello_extra_frame":  # HELLO and, in the same write, one more frame
            extra = m.PONG(req_id=1, rss_mb=1.0)
            assert self.channel is not None  # HELLO is sent on the open channel
            self.channel.sock.sendall(encode_frame(m.encode(hello)) + encode_frame(m.encode(extra)))
            time.sleep(3600)
        return hello

    def after_handshake(self) -> None:
        self.engine.channel = self.channel  # type: ignore[attr-defined]
        if self.fault == "exit_after_hello":
            sys.stderr.write("faulty worker: exiting right after HELLO\n")
            sys.stderr.flush()
            os._exit(3)


def _fields(msg: m.HELLO) -> dict:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}


def _factory(rest: list[str]) -> FaultEngine:
    parser = argparse.ArgumentParser(prog="workers.faulty")
    parser.add_argument("--fault", default=None)
    parser.add_argument("--import-s", type=float, default=None)
    parser.add_argument("--import-at-start", action="store_true")
    args = parser.parse_args(rest)
    FaultRuntime.fault = args.fault
    if args.fault == "crash_on_start":
        sys.stderr.write("faulty worker: crashing before connecting\n")
        sys.exit(3)
    engine = FaultEngine()
    if args.import_s is not None:
        os.environ["SYNAPSE_FAULTY_IMPORT_S"] = str(args.import_s)
        engine.slow_library_pending = True
        if args.import_at_start:
            engine.import_slow_library()
    return engine


if __name__ == "__main__":
    runtime.main(_factory, runtime_class=FaultRuntime)

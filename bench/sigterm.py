"""SIGTERM ends a bench the way Ctrl-C does: by an exception, so its cleanup runs.

Benches start servers and engine processes in sessions of their own (so CFS shares the cores
between the sides fairly), so neither a terminal's signals nor the bench's death reach them.
Under SIGTERM's default action (`timeout`, a CI runner, `kill`) the bench died at once and
they kept running, each holding a model and taking CPU from whatever was measured next.
"""

from __future__ import annotations

import signal
import threading


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises SystemExit(143) in the main thread, so `finally` blocks that
    stop a bench's processes run. Leaves a handler someone else installed alone."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; it starts the processes anyway
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)

"""bench.sigterm's rules, in this process (the handler is restored after each test); that a
bench's servers really stop is proved with real processes in tests/test_bench_serve.py."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from bench.sigterm import exit_on_sigterm


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_then_raises_system_exit_143(default_sigterm) -> None:
    exit_on_sigterm()
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    with pytest.raises(SystemExit) as raised:
        handler(signal.SIGTERM, None)
    assert raised.value.code == 143


def test_a_handler_already_installed_is_left_alone(default_sigterm) -> None:
    def theirs(signum, frame) -> None:
        pass

    signal.signal(signal.SIGTERM, theirs)
    exit_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is theirs


def test_outside_the_main_thread_nothing_changes(default_sigterm) -> None:
    errors: list[BaseException] = []

    def call() -> None:
        try:
            exit_on_sigterm()
        except BaseException as exc:  # signal.signal would raise ValueError here
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

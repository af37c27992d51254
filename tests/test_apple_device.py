"""The macOS adapter's pure parts on any OS: version comparison and the Neural Engine summary
from Core ML's device list (core count read from the device, never guessed from the chip)."""

from __future__ import annotations

import sys

import pytest

from workers.ane import apple_device
from workers.ane.apple_device import summarize_devices, version_at_least


class Device:
    def __init__(self, kind: str, cores: object = None) -> None:
        self.kind = kind
        self._cores = cores

    @property
    def total_core_count(self) -> int:
        if isinstance(self._cores, Exception):
            raise self._cores
        return self._cores  # type: ignore[return-value]


def is_ne(d: Device) -> bool:
    return d.kind == "ne"


def test_the_core_count_comes_from_the_neural_engine_device():
    assert summarize_devices([Device("cpu"), Device("gpu"), Device("ne", 16)], is_ne) == (True, 16)
    assert summarize_devices([Device("ne", 32)], is_ne) == (True, 32)  # Ultra chips: two dies
    assert summarize_devices([Device("cpu"), Device("gpu")], is_ne) == (False, None)
    # An OS whose device has no core count (or a failing native call): unknown, not 16.
    assert summarize_devices([Device("ne", AttributeError("no"))], is_ne) == (True, None)


def test_versions_compare_numerically():
    assert version_at_least("14.4", (14, 4)) and version_at_least("15.0.1", (14, 4))
    assert not version_at_least("14.3.1", (14, 4)) and not version_at_least(None, (14, 4))
    assert version_at_least("26.1", (15, 0)) and not version_at_least("9.9", (10,))


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only: a Mac has the answers")
def test_off_macos_every_answer_is_none_with_the_reason():
    assert apple_device.neural_engine() == (None, None)
    assert apple_device.describe()["reason"] == apple_device.NOT_MACOS
    assert apple_device.describe()["neural_engine_cores"] is None

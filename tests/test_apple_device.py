"""The macOS adapter's pure parts on any OS: version comparison and the Neural Engine summary
from Core ML's device list (core count read from the device, never guessed from the chip)."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize(
    ("stdout", "version"),
    [
        ("26.0.1\n", "26.0.1"),  # macOS 26 as sw_vers says it (mac_ver() may say "16.0")
        ("14.4\n", "14.4"),
        ("  15.7.2  \n", "15.7.2"),
        ("", None),
        ("\n", None),
        ("26.0 beta\n", None),
        ("ProductVersion: 26.0\n", None),  # plain `sw_vers` output: not what we asked for
        ("26..1\n", None),
    ],
)
def test_the_product_version_is_parsed_as_coremltools_reads_it(stdout, version):
    assert apple_device.parse_product_version(stdout) == version


def _fake_sw_vers(bin_dir, body: str) -> None:
    script = bin_dir / "sw_vers"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac runs the real sw_vers below")
def test_the_version_comes_from_sw_vers_product_version(tmp_path, monkeypatch):
    """A real `sw_vers` process on PATH (as coremltools finds it): it answers a version only to
    exactly `-productVersion`, and logs the arguments it was given."""
    log = tmp_path / "argv"
    _fake_sw_vers(
        tmp_path,
        f'printf "%s\\n" "$@" > {log}\n'
        'if [ "$#" -eq 1 ] && [ "$1" = "-productVersion" ]; then echo 26.0.1; exit 0; fi\n'
        "echo 'ProductName: macOS'; exit 1\n",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert apple_device.SW_VERS_ARGV == ("sw_vers", "-productVersion")
    assert apple_device.product_version() == "26.0.1"
    assert log.read_text().splitlines() == ["-productVersion"]
    # A failing or missing sw_vers is "unknown", never a wrong guess.
    _fake_sw_vers(tmp_path, "exit 3\n")
    assert apple_device.product_version() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert apple_device.product_version() is None


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS only: the real sw_vers")
def test_on_macos_the_version_is_sw_vers_product_version():
    import subprocess

    out = subprocess.run(["sw_vers", "-productVersion"], capture_output=True, text=True)
    assert apple_device.macos_version() == out.stdout.strip()

"""workers.llama.cpu_quirks: when llama.cpp's extra buffer types (AMX) are turned off."""

from __future__ import annotations

import sys

import pytest

from workers.llama import cpu_quirks

AMX_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile amx_int8\n"
EPYC_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 fma f16c\n"


def test_amx_is_read_from_the_flags_line():
    assert cpu_quirks.cpu_has_amx(AMX_CPU)
    assert not cpu_quirks.cpu_has_amx(EPYC_CPU)
    assert not cpu_quirks.cpu_has_amx("no flags here\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_this_machine_is_judged_from_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert cpu_quirks.cpu_has_amx() == ("amx_int8" in flags or "amx_tile" in flags)


@pytest.mark.parametrize(
    "env, has_amx, allowed",
    [("auto", True, False), ("auto", False, True), ("1", True, True), ("0", False, False)],
)
def test_policy_and_override(env, has_amx, allowed):
    assert cpu_quirks.extra_buffer_types_allowed(env=env, has_amx=has_amx) is allowed


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="expected 0, 1 or auto"):
        cpu_quirks.extra_buffer_types_allowed(env="yes", has_amx=False)


def test_high_level_constructor_follows_the_policy_only_inside_the_block():
    import llama_cpp.llama as high_level

    with cpu_quirks.high_level_llama_follows_policy():
        inside = high_level.llama_cpp.llama_model_default_params().use_extra_bufts
    outside = high_level.llama_cpp.llama_model_default_params().use_extra_bufts
    assert inside == cpu_quirks.model_params().use_extra_bufts
    assert outside is True  # llama.cpp's own default, restored

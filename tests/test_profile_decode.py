"""benchmarks/profile_decode.py: which ops count as specjax's kernels, and its refusal of a bad flag pair."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def profile_decode():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports benchmarks/common.py
    try:
        spec = importlib.util.spec_from_file_location("profile_decode", BENCHMARKS / "profile_decode.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_custom_calls_are_the_kernels_and_nothing_else(profile_decode):
    hlo = "\n".join([
        '  %ffi_call.12 = f32[1,576]{1,0} custom-call(f32[1,576]{1,0} %x, u8[576,288]{1,0} %q), custom_call_target="q4"',
        "  ROOT %ffi_call.3 = f32[1,8]{1,0} custom-call(f32[1,8]{1,0} %y), custom_call_target=\"int8\"",
        "  %dot.4 = f32[1,8]{1,0} dot(f32[1,4]{1,0} %a, f32[4,8]{1,0} %b)",
        "  %fusion.2 = f32[8]{0} fusion(f32[8]{0} %c), kind=kLoop, calls=%custom-call_like_name",
    ])
    assert profile_decode._custom_calls(hlo) == {"ffi_call.12", "ffi_call.3"}


def test_quantize_needs_the_real_target(profile_decode, capsys):
    with pytest.raises(SystemExit):
        profile_decode.main(["--quantize", "gguf"])
    assert "--quantize gguf needs the real target" in capsys.readouterr().err

"""faast.hardware: whether the CPU multiplies bfloat16 natively (recorded beside speeds; it chooses nothing on a CPU),
from its flags and oneDNN's instruction-set limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from faast import hardware


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU's flags and oneDNN's limit; the cached answer is recomputed for each case."""
    real = Path.read_text

    def make(
        flags: str, limit: str | None = None, name: str = "ONEDNN_MAX_CPU_ISA", ask=hardware.cpu_has_bf16
    ) -> bool:  # noqa: ANN001
        for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            monkeypatch.delenv(var, raising=False)
        if limit is not None:
            monkeypatch.setenv(name, limit)
        monkeypatch.setattr(
            Path, "read_text", lambda p, *a, **k: flags if str(p) == "/proc/cpuinfo" else real(p, *a, **k)
        )
        for cached in (hardware.cpu_has_bf16, hardware.cpu_flags, hardware.cpu_model):
            cached.cache_clear()
        return ask()

    yield make
    for cached in (hardware.cpu_has_bf16, hardware.cpu_flags, hardware.cpu_model):
        cached.cache_clear()


def test_the_flags_decide_without_a_limit(cpu):
    assert cpu("flags : fpu avx2 avx512f avx512_bf16") is True
    assert cpu("flags : fpu avx2 amx_bf16 amx_tile") is True
    assert cpu("flags : fpu avx2 avx512f") is False


@pytest.mark.parametrize("limit", ["AVX2", "avx512_core", "AVX512_CORE_VNNI", "SSE41"])
def test_a_onednn_limit_below_bfloat16_makes_it_emulated(cpu, limit):
    # torch multiplies bfloat16 matrices on a CPU through oneDNN: limited below AVX512_CORE_BF16 it emulates them.
    assert cpu("flags : avx512_bf16 amx_bf16", limit) is False
    assert cpu("flags : avx512_bf16 amx_bf16", limit, name="DNNL_MAX_CPU_ISA") is False


@pytest.mark.parametrize("limit", ["AVX512_CORE_BF16", "avx512_core_amx", "ALL", ""])
def test_a_limit_that_keeps_bfloat16_changes_nothing(cpu, limit):
    assert cpu("flags : avx512_bf16", limit) is True
    assert cpu("flags : avx2", limit) is False


def test_the_flags_are_the_known_instruction_sets_in_a_fixed_order(cpu):
    flags = cpu("model name : X\nflags : fpu fma avx2 sse4_2 amx_tile", ask=hardware.cpu_flags)
    assert flags == ("avx2", "fma", "amx_tile")
    assert cpu("model name : X\nFeatures : fp asimd sve i8mm", ask=hardware.cpu_flags) == ("asimd", "sve", "i8mm")
    assert cpu("", ask=hardware.cpu_flags) == ()
    assert cpu("model name : Some CPU @ 2GHz\nflags : avx2", ask=hardware.cpu_model) == "Some CPU @ 2GHz"

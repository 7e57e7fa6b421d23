"""faast.hardware: whether the CPU multiplies bfloat16 natively, and int8 matrices fast, from its flags and oneDNN's
instruction-set limit."""

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
        hardware.cpu_has_bf16.cache_clear()
        hardware.cpu_has_int8.cache_clear()
        return ask()

    yield make
    hardware.cpu_has_bf16.cache_clear()
    hardware.cpu_has_int8.cache_clear()


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


def test_int8_products_are_fast_from_avx2_unless_onednn_is_limited_below_it(cpu):
    int8 = hardware.cpu_has_int8
    assert cpu("flags : fpu sse4_1 avx avx2 fma", ask=int8) is True
    assert cpu("flags : fpu avx2 avx512f avx512_vnni", ask=int8) is True
    assert cpu("flags : fpu sse4_1 avx fma", ask=int8) is False  # no AVX2
    assert cpu("", ask=int8) is False  # no flags to read
    for limit in ("SSE41", "avx"):
        assert cpu("flags : avx2 avx512_vnni", limit, ask=int8) is False
        assert cpu("flags : avx2 avx512_vnni", limit, name="DNNL_MAX_CPU_ISA", ask=int8) is False
    for limit in ("AVX2", "AVX512_CORE", "ALL", ""):
        assert cpu("flags : avx2", limit, ask=int8) is True

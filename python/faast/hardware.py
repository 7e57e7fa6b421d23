"""What the processor behind a device can do that faast's choices depend on: whether it multiplies bfloat16 natively,
and whether a CPU multiplies int8 matrices faster than float32 ones.

Where bfloat16 is native (a CUDA GPU with bfloat16 support, a CPU with AVX512-BF16 or AMX), faast.hf runs its learning
pass under bfloat16 autocast and takes the residual output layer's head products in bfloat16; elsewhere bfloat16
products are emulated and slower than float32, so it keeps float32, and on an x86 CPU with AVX2 it forms the head's
logits in int8 (faast/hf/head.py). Result files (faast.provenance) record it beside every speed.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

__all__ = ["cpu_has_bf16", "cpu_has_int8", "native_bf16"]

# oneDNN's instruction-set limits (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) that still allow bfloat16 dot products.
# torch multiplies bfloat16 matrices on a CPU through oneDNN, so a lower limit emulates them even on a CPU that has
# the instructions (a run limited to AVX2 stands in for a CPU without AVX-512).
_BF16_ISAS = {
    "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
}  # fmt: skip
# oneDNN's limits below AVX2: its int8 products there lose most of their lead over float32.
_BELOW_AVX2 = {"SSE41", "AVX"}


def _onednn_limit() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo (Linux; False
    elsewhere, where it cannot be read), and oneDNN may use those instructions: False when ONEDNN_MAX_CPU_ISA (or
    DNNL_MAX_CPU_ISA) limits it below them. Read once per process."""
    limit = _onednn_limit()
    if limit and limit not in _BF16_ISAS:
        return False
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def cpu_has_int8() -> bool:
    """Whether this CPU multiplies int8 matrices (torch._int_mm, through oneDNN) well ahead of float32 ones: an x86
    CPU with AVX2, read from /proc/cpuinfo (False elsewhere), with oneDNN not limited below AVX2. On 2 AMD EPYC cores
    a [1024, 576] × [576, 49152] product ran at 2.4× float32's rate with oneDNN limited to AVX2, 2.7× to AVX-512
    without VNNI and 4.8× with AVX512-VNNI (docs/design.md §6.3). Read once per process."""
    if _onednn_limit() in _BELOW_AVX2:
        return False
    return " avx2" in _cpu_flags()


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16 or
    AMX (on other CPUs bfloat16 products are emulated and slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()

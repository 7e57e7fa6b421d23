"""What the processor behind a device can do that faast's choices depend on: whether it multiplies bfloat16 natively.

Where it does (a CUDA GPU with bfloat16 support, a CPU with AVX512-BF16 or AMX), faast.hf runs its learning pass
under bfloat16 autocast and takes the residual output layer's head products in bfloat16; elsewhere bfloat16 products
are emulated and slower than float32, so it keeps float32. Result files (faast.provenance) record it beside every
speed.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

__all__ = ["cpu_has_bf16", "native_bf16"]

# oneDNN's instruction-set limits (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) that still allow bfloat16 dot products.
# torch multiplies bfloat16 matrices on a CPU through oneDNN, so a lower limit emulates them even on a CPU that has
# the instructions (a run limited to AVX2 stands in for a CPU without AVX-512).
_BF16_ISAS = {
    "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
}  # fmt: skip


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo (Linux; False
    elsewhere, where it cannot be read), and oneDNN may use those instructions: False when ONEDNN_MAX_CPU_ISA (or
    DNNL_MAX_CPU_ISA) limits it below them. Read once per process."""
    limit = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if limit and limit not in _BF16_ISAS:
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16 or
    AMX (on other CPUs bfloat16 products are emulated and slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()

"""What the processor behind a device can do that faast's choices depend on: whether it multiplies bfloat16 natively.

Where it does (a CUDA GPU with bfloat16 support, a CPU with AVX512-BF16 or AMX), faast.hf runs its learning pass
under bfloat16 autocast and takes the residual output layer's head products in bfloat16; elsewhere bfloat16 products
are emulated and slower than float32, so it keeps float32. Result files (faast.provenance) record it beside every
speed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["cpu_has_bf16", "native_bf16"]


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo (Linux; False
    elsewhere, where it cannot be read)."""
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

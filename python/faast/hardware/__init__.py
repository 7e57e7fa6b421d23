"""The machine faast runs on: the CPU's name, its instruction-set flags and the torch threads, which key every choice
faast measures (faast.ops' autotune cache), and whether a device multiplies bfloat16 natively, which result files
record beside every speed.

Nothing here chooses a CPU path: a flag may only say that a candidate cannot run. Which of the eligible ones runs is
measured on the machine (docs/backends.md, "How auto chooses"); `python -m faast.hardware` prints those measurements
on the default model's shapes and what `auto` chose.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

__all__ = ["ISA_FLAGS", "cpu_flags", "cpu_has_bf16", "cpu_model", "machine_key", "native_bf16"]

# The instruction-set flags (as /proc/cpuinfo spells them) that change which kernels torch, oneDNN and fbgemm run:
# vector width, dot-product instructions for int8 and bfloat16, and matrix engines (x86 and Arm).
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip
# oneDNN's instruction-set limits (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) that still allow bfloat16 dot products.
# torch multiplies bfloat16 matrices on a CPU through oneDNN, so a lower limit emulates them even on a CPU that has
# the instructions.
_BF16_ISAS = {
    "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
}  # fmt: skip


def _onednn_limit() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform reports). Read once per process."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The ISA_FLAGS this CPU has, in ISA_FLAGS' order (the first 'flags' or Arm 'Features' line of /proc/cpuinfo;
    empty where it cannot be read). Read once per process."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return tuple(f for f in ISA_FLAGS if f in have)
    return ()


def machine_key() -> str:
    """What a measured choice on this CPU depends on besides the shapes: the model, the ISA flags, the torch threads
    and oneDNN's instruction-set limit when one is set. Two machines that differ in any of them measure afresh."""
    flags = " ".join(cpu_flags()) or "no flags read"
    limit = _onednn_limit()
    key = f"{cpu_model()} x{os.cpu_count()} | {flags} | {torch.get_num_threads()} threads"
    return f"{key} | oneDNN limit {limit}" if limit else key


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX) and oneDNN may use those instructions
    (False when ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA limits it below them). Recorded beside speeds; it chooses
    nothing on a CPU. Read once per process."""
    limit = _onednn_limit()
    if limit and limit not in _BF16_ISAS:
        return False
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16 or
    AMX (on other CPUs bfloat16 products are emulated and slower than float32). On CUDA it chooses the learning
    pass's and the head products' precision; on a CPU those are measured."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()

"""pytest-benchmark entry points for the kernels (GPU only): `pytest lab/benchmarks/test_bench_kernels.py`.

The standalone script bench_kernels.py measures the competitors in the same run and writes the result tables.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel timings need a CUDA device")


@pytest.mark.parametrize("precision", ["fp64", "tf32x3"])
def test_gram_64k_1600(benchmark, precision):
    from faast_kernels.gram import gram_accumulate

    keys = torch.randn(1, 65536, 1600, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(1, 65536, 1600, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(1, 65536, device="cuda")

    def run():
        gram_accumulate(keys, values, scores, precision=precision)
        torch.cuda.synchronize()

    benchmark(run)


def test_residual_8k_1600(benchmark):
    from faast_kernels.residual import residual_project

    x = torch.randn(8192, 1600, device="cuda", dtype=torch.bfloat16)
    m = (0.01 * torch.randn(1600, 1600, device="cuda")).to(torch.bfloat16)

    def run():
        residual_project(x, m)
        torch.cuda.synchronize()

    benchmark(run)

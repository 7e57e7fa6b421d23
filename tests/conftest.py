"""Shared fixtures: seeding, NaN-poisoned allocations inside faast, and the gpu marker."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. The variable must be set before faast_kernels
# is imported (triton.jit reads it when a kernel is defined), so it is set here, at collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU, one configuration per kernel: the tests check numbers, and every autotuned variant would compile for each
# of their many shapes and options (test_gram_autotuned_configurations_agree_bitwise runs each configuration).
os.environ.setdefault("FAAST_TRITON_AUTOTUNE", "0")

_PACKAGES = ("faast", "faast_kernels")


def _called_from_package() -> bool:
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name.split(".")[0] in _PACKAGES


def _poison(fn):
    # Every float tensor that faast allocates with torch.empty* starts as NaN under test, so a buffer region the code
    # reads before writing (an unwritten tile, a stale chunk row) poisons the result instead of passing by luck.
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out.is_floating_point() and _called_from_package():
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poison(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poison(torch.Tensor.new_empty))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # get_closest_marker, not `in item.keywords`: parameter ids are keywords too.
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)

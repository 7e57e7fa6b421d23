"""Shared fixtures: seeding, NaN-poisoned allocations inside faast, the gpu marker, CI's Triton requirement, and
faast's own warnings made errors. At the repository's root, so that they hold for the library's tests (tests/) and the
lab's (lab/tests/) alike."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. The variable must be set before faast_kernels
# is imported (triton.jit reads it when a kernel is defined), so it is set here, at collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU, one configuration per kernel: the tests check numbers, and every autotuned variant would compile for each
# of their many shapes and options (test_gram_autotuned_configurations_agree_bitwise runs each configuration).
os.environ.setdefault("FAAST_TRITON_AUTOTUNE", "0")
# auto's measured choices (faast.ops._autotune) are remembered in a file: tests must neither read a developer's nor
# leave one behind, so the session gets its own cache folder (tests of the cache itself use a fresh one each).
_OWN_CACHE_DIR = None
if "FAAST_AUTOTUNE_CACHE" not in os.environ:
    import tempfile

    _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="faast-test-")
    os.environ["FAAST_AUTOTUNE_CACHE"] = os.path.join(_OWN_CACHE_DIR, "autotune.json")

# auto's choices on a CPU (the learning pass's and the head's precision, p·H's pooling, the int8 kernel, eigh) are
# timed on this machine, so what a test computes would depend on its speed: the suite takes each choice's first
# candidate (float32, exact) unmeasured, and the tests of the measured choice turn measuring on with a fake timer.
os.environ.setdefault("FAAST_AUTOTUNE", "0")

_PACKAGES = ("faast", "faast_kernels")

#: Set by CI (.ci/run): the kernel tests skip themselves where Triton is missing, which on CI would silently drop them,
#: so there a missing Triton stops the run before any test.
REQUIRE_TRITON = "FAAST_REQUIRE_TRITON"


def _attributing_package_warnings(warn):
    """warnings.warn, except that a warning raised by faast's own code carries faast's module name (shown at the
    place its stacklevel points to, as usual). Warning filters match the module of that place, which is the caller's
    for faast's warnings; with this, pyproject.toml's `error::Warning:faast` filter turns every faast warning that a
    test does not expect (pytest.warns) into an error, while other packages' warnings keep their filters."""

    def wrapper(message, category=None, stacklevel=1, source=None, **kwargs):
        caller = sys._getframe(1)
        module = caller.f_globals.get("__name__", "")
        if module.split(".")[0] not in _PACKAGES:
            return warn(message, category, stacklevel + 1, source, **kwargs)
        frame = caller
        for _ in range(stacklevel - 1):
            frame = frame.f_back or frame
        category = type(message) if isinstance(message, Warning) else category or UserWarning
        registry = frame.f_globals.setdefault("__warningregistry__", {})
        warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module=module,
                               registry=registry, source=source)  # fmt: skip

    wrapper.original = warn
    return wrapper


def pytest_configure(config):
    warnings.warn = _attributing_package_warnings(warnings.warn)
    if os.environ.get(REQUIRE_TRITON, "0") in ("", "0"):
        return
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise pytest.UsageError(
            f"{REQUIRE_TRITON} is set (CI), but triton cannot be imported ({err}), so the Triton kernel tests "
            "(tests/test_triton_kernels.py, tests/test_triton_backend.py) would be skipped. Install the test extra "
            "(pip install -e '.[test]', Linux), or unset the variable on a machine without Triton."
        ) from err


def pytest_unconfigure(config):
    warnings.warn = getattr(warnings.warn, "original", warnings.warn)
    if _OWN_CACHE_DIR is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


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


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """auto's measured choices on (faast.ops._autotune), a fresh cache, and a fake timer: `timed.times[name]` seconds
    per candidate (default 1.0; a value that is an exception is raised), `timed.sampled` the candidates timed, in
    order."""
    from faast.ops import _autotune, _dispatch

    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.setenv(_autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(_dispatch, "_logged", set())
    _autotune.forget_memory()

    class Timed:
        times: dict[str, object] = {}
        sampled: list[str] = []
        path = tmp_path / "autotune.json"

    def factory(device):
        def timer(name, run):
            Timed.sampled.append(name)
            run()
            value = Timed.times.get(name, 1.0)
            if isinstance(value, Exception):
                raise value
            return value

        return timer

    _autotune.set_timer(factory)
    yield Timed
    _autotune.set_timer(None)
    _autotune.forget_memory()

"""faast.hf.tokens (public token-id helpers) and the public backend names of faast.ops."""

import pytest
import torch

from faast import ops
from faast.hf.tokens import overlapping_windows, pad_rows


@pytest.mark.parametrize("length, max_length", [(0, 4), (1, 4), (2, 2), (7, 3), (9, 4), (10, 10), (11, 10)])
def test_windows_hold_every_adjacent_pair_exactly_once(length, max_length):
    ids = list(range(100, 100 + length))
    windows = list(overlapping_windows(ids, max_length))
    pairs = [(w[i], w[i + 1]) for w in windows for i in range(len(w) - 1)]
    assert sorted(pairs) == [(ids[i], ids[i + 1]) for i in range(length - 1)]
    assert all(2 <= len(w) <= max_length for w in windows)


def test_pad_rows_right_pads_with_a_mask_of_the_real_tokens():
    ids, mask = pad_rows([[5, 6, 7], [8]], pad_id=-1)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.tolist() == [[5, 6, 7], [8, -1, -1]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_token_helpers_name_the_bad_argument():
    with pytest.raises(ValueError, match="rows"):
        pad_rows([])
    with pytest.raises(ValueError, match="max_length"):
        list(overlapping_windows([1, 2, 3], 1))


def test_the_backend_variable_chooses_the_backend_and_an_unmet_request_raises(monkeypatch):
    from faast.ops import _dispatch

    assert ops.BACKEND_ENV_VAR == _dispatch.ENV_VAR
    monkeypatch.setenv(ops.BACKEND_ENV_VAR, "torch")
    assert _dispatch.resolve("eigh", torch.device("cpu"))[0] == "torch"
    monkeypatch.setenv(ops.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(RuntimeError):
        _dispatch.resolve("eigh", torch.device("cpu"))


def test_native_extension_error_says_why_when_it_cannot_load():
    error = ops.native_extension_error()
    try:
        import faast._C  # noqa: F401
    except ImportError:
        assert isinstance(error, str) and error
    else:
        assert error is None or isinstance(error, str)

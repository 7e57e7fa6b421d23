"""int8 products of float32 rows on a CPU: y = x·Wᵀ for rows x [n, k] and a weight W [m, k], both float32, formed
from int8 factors with exact integer sums. The learning pass's linears (faast/hf/int8_pass.py) and the LM head's
logits (faast/hf/head.py) run through `int8_linear` when their precision is int8.

The arithmetic, whichever kernel runs it: the `outliers` columns of x largest in magnitude over its rows are
multiplied in float32 (a transformer's residual stream has a few channels 10-20× its RMS, which would coarsen every
other entry's int8 step); the rest of each row of x is scaled by that row's own max |x|, each row of W by its own
max |w|, both rounded to integers, their products summed exactly, and the sums scaled back.

Two kernels compete as the op ``int8_linear`` (faast.ops._dispatch: timed per shape class on the machine, cached,
``FAAST_BACKEND=int8_linear=torch.fbgemm`` pins one):

* ``torch``: torch._int_mm (int8 · int8, int32 sums). torch runs it through oneDNN's VNNI or AMX kernels where the
  CPU has them, and through a plain loop elsewhere: on 2 AMD EPYC cores with AVX2 and no AVX-512 it ran at
  2-3 GOP/s, 12-15× slower than float32 (docs/backends.md).
* ``torch.fbgemm``: fbgemm's dynamically quantized linear (torch.ops.quantized.linear_dynamic on a per-channel int8
  weight), which has AVX2 and AVX-512 kernels. It quantizes its whole input on one scale, so each row is divided by
  its own max |x| first and the output multiplied back: the same per-row scales as above. Its inputs are 7-bit
  (reduce_range): its AVX2 kernel adds pairs of uint8·int8 products in saturating int16, and 8-bit inputs gave a
  99% error on rows of large same-sign entries. torch 2.13 deprecates creating quantized tensors (the packed
  weight needs one); the warning is silenced at packing, and where a later torch drops the ops the candidate
  cannot run and the other one is used.

`int8_linear_reference` is the naive oracle of the ``torch`` kernel's arithmetic in float64.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from . import _autotune, _dispatch

__all__ = ["INT8_OUTLIERS", "Int8Input", "Int8Weight", "int8_kernel", "int8_linear", "int8_linear_reference"]

# Columns of x multiplied in float32. On SmolLM2 at 1,024 positions of four text domains the head's learned
# gradients erred by 7.8-9.1% against float64 with none, 1.6-1.8% with 16, 1.1-1.3% with 32, 1.0-1.2% with 64.
INT8_OUTLIERS = 32
# The measured choice times each kernel on at most this many rows and weight rows of the call (a whole head, 49,152
# rows, would take seconds through a slow kernel; GEMMs of this size already run at their full rate).
SAMPLE_ROWS = 128
SAMPLE_WEIGHT_ROWS = 4096
_TINY = torch.finfo(torch.float32).tiny


def _fbgemm_cannot_run(call: _dispatch.Call) -> str | None:
    if call.device.type != "cpu":
        return f"fbgemm runs on the CPU only, got {call.device.type} tensors"
    return _fbgemm_missing()


@functools.cache
def _fbgemm_missing() -> str | None:
    """Why fbgemm's dynamic linear cannot run in this torch build; None when a tiny product runs."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return f"this torch has no fbgemm engine (it has {torch.backends.quantized.supported_engines})"
    try:
        weight = Int8Weight(torch.ones(2, 2))
        torch.ops.quantized.linear_dynamic(torch.ones(1, 2), weight.packed(), True)
    except Exception as err:  # noqa: BLE001 - a torch without the ops or the engine: the reason, verbatim
        return f"fbgemm's dynamic linear does not run here ({type(err).__name__}: {err})"[:300]
    return None


def _int_mm_cannot_run(call: _dispatch.Call) -> str | None:
    return None if call.device.type == "cpu" else f"faast's int8 products run on the CPU only, got {call.device.type}"


class Int8Weight:
    """A float32 weight W [m, k] and its int8 forms, each made once, when a kernel first asks for it: `rows()`
    (q [m, k] int8 and scale [m] float32, W ≈ q·scale[:, None]: torch._int_mm's) and `packed()` (fbgemm's
    prepacked per-channel int8 weight: the same q and scale)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"weight: expected a float32 matrix [m, k], got {weight.dtype} {list(weight.shape)}")
        self.w32 = weight.detach()
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed: object | None = None

    @property
    def shape(self) -> torch.Size:
        return self.w32.shape

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [m, k] int8, scale [m] float32): each row of W on its own symmetric scale max|row| / 127."""
        if self._rows is None:
            scale = self.w32.abs().amax(1).clamp_min(_TINY) / 127
            self._rows = torch.round(self.w32 / scale[:, None]).to(torch.int8), scale
        return self._rows

    def packed(self) -> object:
        """fbgemm's packed form of `rows()` (torch.ops.quantized.linear_prepack)."""
        if self._packed is None:
            q, scale = self.rows()
            zero = torch.zeros(q.shape[0], dtype=torch.long)
            with warnings.catch_warnings():
                # torch 2.13: "quantized tensor creation functions ... are deprecated" (module docstring).
                warnings.filterwarnings("ignore", message=".*quantized tensor creation.*", category=UserWarning)
                qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        return self._packed

    def head(self, m: int) -> Int8Weight:
        """The first m rows of W as their own Int8Weight (the measured choice's sample)."""
        return self if m >= self.shape[0] else Int8Weight(self.w32[:m])

    def nbytes(self) -> int:
        """Bytes of the int8 forms made so far (the packed form counted as its int8 matrix)."""
        if self._rows is None:
            return 0
        q, scale = self._rows
        return (q.numel() + 4 * scale.numel()) * (2 if self._packed is not None else 1)


class Int8Input:
    """Rows x [n, k] float32 prepared for int8 products (the module docstring's arithmetic): the outlier columns, the
    rest of x with them zeroed, each row's max |x| of the rest, and, made once when a kernel first asks, the rows in
    that kernel's form. Linears that share an input (a block's q, k and v projections) share one Int8Input."""

    def __init__(self, x: torch.Tensor, outliers: int = INT8_OUTLIERS) -> None:
        self.x, self.outliers, self.version = x, int(outliers), x._version
        magnitude = x.abs()
        c = min(self.outliers, x.shape[1])
        # nan_to_num: a masked position's NaN must not choose the columns (its own row is dropped by the caller);
        # the row maxima keep it, so that row's output is NaN whatever the kernel.
        self.columns = torch.nan_to_num(magnitude, 0).amax(0).topk(c).indices
        self.rest = x.index_fill(1, self.columns, 0)
        self.row_max = magnitude.index_fill_(1, self.columns, 0).amax(1, keepdim=True).clamp_min(_TINY)
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unit: torch.Tensor | None = None

    def same(self, x: torch.Tensor, outliers: int) -> bool:
        """Whether this was prepared from x as it is now (the same storage, version and shape)."""
        mine = self.x
        return (outliers == self.outliers and x.data_ptr() == mine.data_ptr() and x._version == self.version
                and x.shape == mine.shape and x.stride() == mine.stride())  # fmt: skip

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rest rounded to int8 on each row's scale max|x| / 127 [n, k], that scale [n, 1] float32)."""
        if self._int8 is None:
            row_scale = self.row_max / 127
            self._int8 = torch.round(self.rest / row_scale).to(torch.int8), row_scale
        return self._int8

    def unit(self) -> torch.Tensor:
        """The rest with each row divided by its max |x| [n, k] float32, NaN rows zeroed (module docstring)."""
        if self._unit is None:
            # A NaN row would make fbgemm's one input scale NaN for every row: zeroed here; row_max keeps it NaN.
            self._unit = (self.rest / self.row_max).nan_to_num_(0, 0, 0)
        return self._unit


def _add_outliers(out: torch.Tensor, rows: Int8Input, weight: Int8Weight) -> torch.Tensor:
    return out.addmm_(rows.x.index_select(1, rows.columns), weight.w32.index_select(1, rows.columns).T)


def _int_mm_linear(
    rows: Int8Input, weight: Int8Weight, out: torch.Tensor | None, acc: torch.Tensor | None
) -> torch.Tensor:
    xq, row_scale = rows.int8()
    q, scale = weight.rows()
    sums = torch._int_mm(xq, q.T, out=acc)
    # A copy into float32, then two in-place scalings: 29 ms for [1,024, 49,152] against 92 ms for one mixed-dtype
    # torch.mul (2 AMD EPYC cores).
    out = sums.float() if out is None else out.copy_(sums)
    out.mul_(row_scale).mul_(scale)
    return _add_outliers(out, rows, weight)


def _fbgemm_linear(
    rows: Int8Input, weight: Int8Weight, out: torch.Tensor | None, acc: torch.Tensor | None
) -> torch.Tensor:
    del acc  # fbgemm keeps its own int32 sums
    y = torch.ops.quantized.linear_dynamic(rows.unit(), weight.packed(), True).mul_(rows.row_max)
    out = y if out is None else out.copy_(y)
    return _add_outliers(out, rows, weight)


def register() -> None:
    """Add int8_linear's kernels to the torch backend (faast.ops registers it first)."""
    # fbgemm first: the choice when measuring is off (FAAST_AUTOTUNE=0), since it has AVX2 kernels and _int_mm may not.
    _dispatch.register_variant("torch", "int8_linear", "fbgemm", _fbgemm_linear, cannot_run=_fbgemm_cannot_run)
    _dispatch.register_variant("torch", "int8_linear", "int_mm", _int_mm_linear, cannot_run=_int_mm_cannot_run)


def _call(device: torch.device, n: int, weight: Int8Weight) -> _dispatch.Call:
    # Rows and weight rows beyond what the sample takes share a class: they are measured on the same sample.
    m, k = weight.shape
    rows, cols = _autotune.size_class(min(n, SAMPLE_ROWS)), _autotune.size_class(min(m, SAMPLE_WEIGHT_ROWS))
    return _dispatch.Call("int8_linear", device, (torch.float32,), ((n, k), (m, k)),
                          shape_class=f"rows{rows} k{k} m{cols}")  # fmt: skip


def _resolve(rows: Int8Input, weight: Int8Weight) -> tuple[str, Callable]:
    sample = Int8Input(rows.x[:SAMPLE_ROWS], rows.outliers)
    sample_w = weight.head(SAMPLE_WEIGHT_ROWS)
    return _dispatch.resolve(
        "int8_linear", rows.x.device, _call(rows.x.device, rows.x.shape[0], weight),
        lambda fn: fn(sample, sample_w, None, None),
    )  # fmt: skip


def int8_kernel(rows: int, weight: Int8Weight, outliers: int = INT8_OUTLIERS) -> str:
    """The kernel int8_linear runs for `rows` rows through `weight` on the CPU ('torch.int_mm' or 'torch.fbgemm'),
    measured now if this machine has not measured that shape class yet (random rows stand in for the data)."""
    sample = torch.randn(min(max(rows, 1), SAMPLE_ROWS), weight.shape[1])
    return _resolve(Int8Input(sample, outliers), weight)[0]


def int8_linear(
    x: torch.Tensor | Int8Input,
    weight: Int8Weight,
    *,
    outliers: int = INT8_OUTLIERS,
    out: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, k] float32 (CPU) times Wᵀ through int8 factors (module docstring): [n, m] float32, without a bias.

    x: the rows, or an Int8Input already made from them (reused across linears that share them; its own outliers
    count then holds). weight: W [m, k] with its int8 forms (`Int8Weight`). outliers: columns of x multiplied in
    float32. out: an [n, m] float32 tensor to write into; acc: an [n, m] int32 one for torch._int_mm's sums (the
    fbgemm kernel keeps its own). The kernel is the measured choice (module docstring); raises ValueError naming x
    for anything but float32 rows of width k on the CPU."""
    rows = x.x if isinstance(x, Int8Input) else x
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.device.type != "cpu" or rows.shape[1] != weight.shape[1]:
        raise ValueError(f"x: expected float32 CPU rows [n, {weight.shape[1]}], got {rows.dtype} {list(rows.shape)} "
                         f"on {rows.device}")  # fmt: skip
    if rows.shape[0] == 0:
        return torch.empty((0, weight.shape[0])) if out is None else out
    prepared = x if isinstance(x, Int8Input) else Int8Input(rows, outliers)
    _, impl = _resolve(prepared, weight)
    return impl(prepared, weight, out, acc)


def int8_linear_reference(x: torch.Tensor, weight: Int8Weight, outliers: int = INT8_OUTLIERS) -> torch.Tensor:
    """The ``torch.int_mm`` kernel's arithmetic in float64, the oracle of tests: [n, m] float64 (integer sums are exact
    in float64 far beyond these sizes)."""
    rows = Int8Input(x.float(), outliers)
    xq, row_scale = rows.int8()
    q, scale = weight.rows()
    out = (xq.double() @ q.double().T) * row_scale.double() * scale.double()
    return out + x.double().index_select(1, rows.columns) @ weight.w32.double().index_select(1, rows.columns).T

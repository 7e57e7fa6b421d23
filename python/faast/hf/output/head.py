"""The LM head's products the residual output layer learns from (docs/design.md §6.3): logits of rows through the
head, and the next-token log-likelihood gradients with the sums of the head's Fisher, from those logits.

For the head's input h̃ [d] the model predicts p = softmax(h̃ Hᵀ) (H [V, d], the head's weight); the gradient of
log p_y with respect to h̃ is r = H[y] − pH. Learning (faast/hf/output.py) and reading a stream (faast/hf/reading.py)
both go through `head_gradients`; a stream passes the logits it already computed to score the text.

The products' dtype (`products_dtype`): float32, bfloat16, or int8 for the logits alone (faast.ops.int8), whose p·H
then stays float32. Under ResidualOutput.head_dtype='auto' a CPU times the three on the head's own shape and keeps the
fastest (faast.ops.paths, op head_logits); a GPU takes bfloat16 where it is native, else float32. Whether p·H pools
the vocabulary columns no position gives much probability is timed the same way on a CPU (op head_pool), on the
first block's own probabilities; the threshold 'auto' pools at is OutputPolicy.pool_auto.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from ...hardware import native_bf16
from ...ops import paths
from ...ops.int8 import INT8_OUTLIERS, Int8Weight, int8_linear
from ..call_scope import CallScope
from ..targets import LMHead
from .policy import DEFAULT_POLICY, OutputPolicy

READ_CHUNK = 1024  # positions per logits block: bounds the [chunk, V] temporaries
# From this many rows in a block, 16-bit p·H runs as (Hᵀ pᵀ)ᵀ against a contiguous Hᵀ [d, V]: for SmolLM2 in bfloat16
# it took 45 ms instead of 78 ms at 1,016 rows, and 5.4 ms instead of 6.2 ms at 100, but 6.0 ms instead of 2.9 ms at
# 8 (2 Intel Xeon cores with native bfloat16, oneDNN). Float32 products keep p·H: its pooled form was faster so.
TRANSPOSED_FROM = 512
# The measured choice of the head products' dtype times each on this many random rows through this many of the
# head's rows (the first ones): a product of this size runs at the full rate, and a slow candidate costs under 1 s.
HEAD_SAMPLE_ROWS = 256
HEAD_SAMPLE_VOCAB = 4096


def head_weight(head: LMHead) -> torch.Tensor:
    """The LM head's weight H [V, d] (any dtype), checked to be a tensor (a module's attributes are typed loosely)."""
    weight = head.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"head: expected a module whose weight is a tensor [V, d], got {type(weight).__name__}")
    return weight


def head_logits(head: LMHead, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [n, V] float32 of rows hidden [n, d] through the LM head (weight [V, d], optional bias). `weight`: the
    head's weight already cast to the products' dtype (float32 or bfloat16; default float32)."""
    weight = head_weight(head).float() if weight is None else weight
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    bias = getattr(head, "bias", None)
    return logits if bias is None else logits + bias.float()


def head_second_moment(weight: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Hᵀ diag(mass) H [d, d] float64 for the head's weight H [V, d] and a mass [V] per token (Σ p), formed in float32
    blocks of the vocabulary and summed in float64."""
    out = torch.zeros((weight.shape[1],) * 2, dtype=torch.float64, device=weight.device)
    for i in range(0, weight.shape[0], 8192):
        h = weight[i : i + 8192].float()
        out += ((h.T * mass[i : i + 8192].float()) @ h).double()
    return out


def change_logits(
    head: LMHead, change: torch.Tensor, out: torch.Tensor | None = None, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The change [n, V] of the head's logits for a change [n, d] of its input: change·Hᵀ, without the head's bias (it
    cancels), in the dtype of `weight`, the head's weight already cast to the products' dtype (float32 or bfloat16;
    default float32): bfloat16 products accumulate in float32 and round once on output. out: a [n, V] tensor of that
    dtype to write it into (rows of a larger buffer: two calls on complementary rows fill one)."""
    weight = head_weight(head).float() if weight is None else weight
    return torch.matmul(change.to(weight.dtype), weight.T, out=out)


class HeadBuffers:
    """The [READ_CHUNK, V] buffers head_gradients fills (logits and probabilities, 200 MB each in float32 for
    SmolLM2), and the head's weight cast to the products' dtype (H and Hᵀ), kept across its calls while `kept()`
    lasts: one learn() call, whose batches each call it. Outside `kept()` every call gets fresh ones and nothing is
    held. Fresh pages for every batch cost: kept, the bfloat16 head products of 8,160 asyncio positions in
    2,040-position batches took 1.57 s instead of 2.03 s (float32: 3.54 s instead of 3.66 s), and the default
    learning of 8K asyncio tokens 5.4-5.5 s instead of 5.7-5.8 s (3 interleaved runs; 2 Intel Xeon cores with native
    bfloat16)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._casts: dict[tuple, torch.Tensor] = {}
        self._int8: dict[tuple, Int8Weight] = {}
        self.scope = CallScope(self.drop)

    def kept(self) -> contextlib.AbstractContextManager[None]:
        """Hold the buffers and casts formed inside (one learn() call); free them when the outermost block ends."""
        return self.scope.kept()

    def drop(self) -> None:
        """Free the buffers and casts held."""
        self._buffers.clear()
        self._casts.clear()
        self._int8.clear()

    def held_bytes(self) -> int:
        """Bytes the buffers and weight casts hold now (0 outside `kept()`)."""
        held = [*self._buffers.values(), *self._casts.values()]
        return sum(b.numel() * b.element_size() for b in held) + sum(w.nbytes() for w in self._int8.values())

    def weight(self, weight: torch.Tensor, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
        """The head's weight [V, d] cast to `dtype`, or with transposed=True its transpose [d, V] contiguous; inside
        `kept()` cast once per weight (a weight changed in place, or another tensor, is cast again). A weight already
        in `dtype` is itself, never held."""
        if not transposed and weight.dtype == dtype:
            return weight
        if not self.scope.active:
            return _cast(weight, dtype, transposed)
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), dtype, transposed)
        held = self._casts.get(key)
        if held is None:
            # One cast per (dtype, layout): an older version of the weight is dropped, not kept beside it.
            for old in [k for k in self._casts if k[3:] == key[3:]]:
                del self._casts[old]
            held = self._casts[key] = _cast(weight, dtype, transposed)
        return held

    def int8(self, weight: torch.Tensor) -> Int8Weight:
        """The head's weight [V, d] with its int8 forms (faast.ops.int8.Int8Weight), formed once per weight inside
        `kept()` like `weight`'s casts."""
        if not self.scope.active:
            return Int8Weight(weight.detach().float())
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key not in self._int8:
            self._int8.clear()  # one int8 form: an older version of the weight is dropped
            self._int8[key] = Int8Weight(weight.detach().float())
        return self._int8[key]

    def get(self, name: str, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [rows, vocab] `dtype` buffer for `name` (its contents are whatever the last call left)."""
        if not self.scope.active:
            return torch.empty((rows, vocab), dtype=dtype, device=device)
        key = (name, dtype, device)
        held = self._buffers.get(key)
        if held is None or held.shape[0] < rows or held.shape[1] != vocab:
            held = self._buffers[key] = torch.empty((rows, vocab), dtype=dtype, device=device)
        return held[:rows]


def _first(buffer: torch.Tensor | None, n: int) -> torch.Tensor:
    """The first n rows of a buffer head_gradients made for this path (None only on paths that never read it)."""
    if buffer is None:
        raise RuntimeError("head_gradients: a buffer this path reads was not made (a bug in faast)")
    return buffer[:n]


def _cast(weight: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    return weight.T.to(dtype, memory_format=torch.contiguous_format) if transposed else weight.to(dtype)


def products_dtype(setting: str, keys: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the head products learning takes for keys [.., d] through the head's weight [V, d] under
    ResidualOutput.head_dtype `setting`. 'auto': on a CPU the fastest of float32, bfloat16 and int8 on the head's own
    shape, measured once per machine (`measured_products`); on a GPU bfloat16 where it is native, else float32;
    float32 for float64 keys anywhere (kept exact, as the tests' references are). int8 forms the logits alone in int8
    (faast.ops.int8), p·H staying float32, on a CPU only (ValueError elsewhere)."""
    if setting == "int8" and keys.device.type != "cpu":
        raise ValueError(f"ResidualOutput.head_dtype: 'int8' runs on a CPU only (faast.ops.int8), got the model on "
                         f"{keys.device}; expected 'auto', 'float32' or 'bfloat16' there")  # fmt: skip
    if setting != "auto":
        return getattr(torch, setting)
    if keys.dtype == torch.float64:
        return torch.float32
    if keys.device.type != "cpu":
        return torch.bfloat16 if native_bf16(keys.device) else torch.float32
    return getattr(torch, measured_products(weight, keys.dtype))


def head_shape_class(weight: torch.Tensor, keys_dtype: torch.dtype) -> str:
    """What the head products' cost depends on: the head's shape and the keys' dtype (the cache's key)."""
    vocab, d = weight.shape
    return f"V{vocab} d{d} keys {str(keys_dtype).split('.')[-1]}"


def measured_products(weight: torch.Tensor, keys_dtype: torch.dtype) -> str:
    """'float32', 'bfloat16' or 'int8': the fastest head logits on this CPU for the head's weight [V, d] (CPU), timed
    on HEAD_SAMPLE_ROWS random rows through its first HEAD_SAMPLE_VOCAB rows the first time this machine meets the
    shape, then cached (faast.ops.paths; FAAST_BACKEND=head_logits=torch.<mode> pins it)."""
    shape_class = head_shape_class(weight, keys_dtype)
    runs: dict[str, Callable[[], object]] = {}
    if paths.current("head_logits", weight.device, shape_class) is None:  # to be measured: prepare every mode
        block = weight.detach()[:HEAD_SAMPLE_VOCAB].float()
        rows = torch.randn(HEAD_SAMPLE_ROWS, block.shape[1])
        for mode in paths.runnable("head_logits", weight.device):
            if mode == "int8":
                int8_weight = Int8Weight(block)
                runs[mode] = functools.partial(int8_linear, rows, int8_weight)
            else:
                cast = block.to(getattr(torch, mode))
                runs[mode] = functools.partial(_logits_in, rows, cast)
            # One untimed call: the int8 kernel's own measured choice and the weight's int8 forms are made here,
            # not inside the timing of this choice.
            runs[mode]()
    return paths.choose("head_logits", weight.device, shape_class, lambda mode: runs[mode]())


def _logits_in(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.matmul(rows.to(weight.dtype), weight.T).float()


def float_products(products: torch.dtype) -> torch.dtype:
    """The floating dtype of the products other than int8 logits (p·H, the step's tuning z1): float32 for int8."""
    return torch.float32 if products == torch.int8 else products


def pool_threshold(
    setting: float | str, products: torch.dtype, keys: torch.Tensor, policy: OutputPolicy = DEFAULT_POLICY
) -> float | None:
    """The probability below which p·H pools a vocabulary column, for ResidualOutput.head_pool_below `setting` with
    head products of dtype `products` and keys [.., d]. 'auto': None on a CPU (`head_gradients` times pooling against
    the exact product on its first block, `measured_pool`); policy.pool_auto for float32 and int8 products on a GPU; 0
    (exact) for 16-bit products on a GPU (pooling them has not been measured there) and for float64 keys anywhere
    (kept exact, as the tests' references are)."""
    if setting != "auto":
        return float(setting)
    if keys.dtype == torch.float64:
        return 0.0
    if keys.device.type == "cpu":
        return None
    return policy.pool_auto if float_products(products) == torch.float32 else 0.0


def pool_shape_class(weight: torch.Tensor, products: torch.dtype) -> str:
    vocab, d = weight.shape
    return f"V{vocab} d{d} products {str(products).split('.')[-1]}"


def measured_pool(
    p: torch.Tensor,
    weight: torch.Tensor,
    w32: torch.Tensor,
    products: torch.dtype,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> float:
    """policy.pool_auto or 0: whether pooling p·H (`pooled_product`) is faster than the exact product on this CPU,
    timed on one block's probabilities p [n, V] float32 with the head's weight in the products' floating dtype
    (`weight`) and in float32, the first time this machine meets the shape, then cached
    (FAAST_BACKEND=head_pool=torch.exact or torch.pooled pins it)."""

    def run(mode: str) -> torch.Tensor:
        if mode == "pooled":
            return pooled_product(p, weight, w32, policy.pool_auto, dense_share=policy.pool_dense_share)
        return (p.to(weight.dtype) @ weight).float()

    mode = paths.choose("head_pool", p.device, pool_shape_class(w32, products), run)
    return policy.pool_auto if mode == "pooled" else 0.0


def pooled_product(
    p: torch.Tensor,
    weight: torch.Tensor,
    w32: torch.Tensor,
    pool: float,
    column_sum: torch.Tensor | None = None,
    dense_share: float = DEFAULT_POLICY.pool_dense_share,
) -> torch.Tensor:
    """μ ≈ pH [n, d] float32 for probabilities p [n, V] float32 (rows summing to 1) and the head's weight [V, d] in
    the products' dtype (`weight`) and in float32 (`w32`). The columns whose probability stays below `pool` in every
    row are pooled: each row puts its mass on them, 1 − Σ_kept p, on their mean row of H weighted by the rows' summed
    probabilities. The rows' sum Σμ is exact, so the learned gradient sum is; each row errs by at most its pooled
    mass times the spread of those rows of H. column_sum: p.sum(0) [V] float32 when the caller has it. A row of
    zeros (a position not learned) comes out as the pooled row: head_gradients fills it. dense_share: with more than
    this share of the vocabulary kept, the full product is formed instead (OutputPolicy.pool_dense_share)."""
    vocab = p.shape[1]
    kept = (p.amax(0) >= pool).nonzero().squeeze(1)
    if kept.numel() > dense_share * vocab:
        return (p.to(weight.dtype) @ weight).float()
    p_kept = p.index_select(1, kept)
    mu = (p_kept.to(weight.dtype) @ weight.index_select(0, kept)).float()
    pooled = p.sum(0) if column_sum is None else column_sum.clone()
    pooled[kept] = 0
    # Without a device sync: no pooled mass gives a zero row, at zero mass per row.
    mean = (pooled @ w32) / pooled.sum().clamp_min(torch.finfo(torch.float32).tiny)
    return mu.addr_(1 - p_kept.sum(1), mean)


@torch.no_grad()
def head_gradients(
    head: LMHead,
    keys: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    products: torch.dtype,
    logits: torch.Tensor | None = None,
    pool: float | None = 0.0,
    buffers: HeadBuffers | None = None,
    policy: OutputPolicy = DEFAULT_POLICY,
    chunk: int | None = None,
    outliers: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the head's inputs keys [B, T-1, d] (h̃), the next tokens targets [B, T-1] and mask [B, T-1] (bool): (the
    log-likelihood gradients r = H[y] − pH [B, T-1, d] float32, zero where masked; Σ μ μᵀ [d, d] and Σ p [V] float64
    over unmasked positions; μ = pH). products: the dtype of the head products (`products_dtype`). logits: the
    head's logits of the same positions [B, T-1, V] when already computed (a stream scored them), else they are
    formed here. pool: p·H pools the vocabulary columns whose probability stays below it in every row of a block
    (`pooled_product`, `pool_threshold`; a block keeping more than policy.pool_dense_share of the vocabulary forms it
    in full); 0 forms it exactly; None: policy.pool_auto or 0, whichever is faster on this CPU (`measured_pool`, timed
    on the first block). buffers: where the [chunk, V] buffers come from (a learn() call's batches share them); None:
    fresh ones. chunk: positions per block (None: READ_CHUNK, read now); the blocks bound the [chunk, V] buffers and
    are what pooling decides on. outliers: the key columns int8 logits multiply in float32 (None: INT8_OUTLIERS,
    faast.ops.int8's, read now)."""
    chunk = READ_CHUNK if chunk is None else chunk
    outliers = INT8_OUTLIERS if outliers is None else outliers
    for name, value, low in (("chunk", chunk, 1), ("outliers", outliers, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: expected an int >= {low} or None, got {value!r}")
    weight = head_weight(head)
    d, vocab = keys.shape[-1], weight.shape[0]
    flat, ys, keep = keys.reshape(-1, d), targets.reshape(-1), mask.reshape(-1)
    given = None if logits is None else logits.reshape(flat.shape[0], -1)
    grads = torch.empty((flat.shape[0], d), dtype=torch.float32, device=keys.device)
    prob_sum = torch.zeros(vocab, dtype=torch.float64, device=keys.device)
    mean_gram = torch.zeros((d, d), dtype=torch.float64, device=keys.device)
    source = HeadBuffers() if buffers is None else buffers
    w32 = source.weight(weight, torch.float32)
    # The two V×d products per position are most of learning's cost beyond the backbone: in bfloat16 (float32
    # accumulation) they took 0.65× the time, and held-out perplexity moved by at most 0.04 points on three
    # validation domains (docs/design.md §6.3).
    wp = source.weight(weight, float_products(products))
    # int8 products are the logits' alone: p·H stays float32 (a probability's int8 step would drop the small ones).
    w8 = source.int8(weight) if products == torch.int8 and given is None else None
    # The [chunk, V] logits and probabilities go into buffers allocated once, not fresh tensors per chunk (200 MB each
    # in float32); 16-bit logits are copied into a float32 buffer before the softmax, and the probabilities into a
    # 16-bit buffer for p·H (a softmax that upcasts its 16-bit input, and p.to(bfloat16), each took twice as long);
    # the mask product is skipped when every position is learned. Together: 16% less time in float32 and 35% less in
    # bfloat16 (4,096 positions, 2 Intel Xeon cores; identical results).
    # In place only for the head's own products: a head with a bias, or given logits, keep the general path.
    into_buffers = given is None and getattr(head, "bias", None) is None
    rows_max = min(chunk, flat.shape[0])
    sixteen = float_products(products) != torch.float32
    # Hᵀ [d, V] for the blocks of TRANSPOSED_FROM rows or more (cast once per learn() call inside HeadBuffers.kept()).
    wp_t = source.weight(weight, products, transposed=True) if sixteen and rows_max >= TRANSPOSED_FROM else None

    def buffer(name: str, dtype: torch.dtype) -> torch.Tensor:
        return source.get(name, rows_max, vocab, dtype, keys.device)

    z_buf = buffer("z", torch.float32) if into_buffers else None
    p_buf = buffer("p", torch.float32)
    z16_buf = buffer("z16", products) if into_buffers and sixteen else None
    p16_buf = None  # made once p·H is known to be exact: the pooled product casts its own slice
    acc_buf = buffer("acc", torch.int32) if w8 is not None else None
    bias = getattr(head, "bias", None)
    every_kept = bool(keep.all())  # one host sync per call, not one per chunk
    for i in range(0, flat.shape[0], chunk):
        rows = slice(i, i + chunk)
        n = flat[rows].shape[0]
        if given is not None:
            z = given[rows]
        elif w8 is not None:
            out = _first(z_buf, n) if into_buffers else None
            z = int8_linear(flat[rows].float(), w8, outliers=outliers, out=out, acc=_first(acc_buf, n))
            z = z if bias is None else z.add_(bias.float())
        elif into_buffers and sixteen:
            z = _first(z_buf, n).copy_(torch.matmul(flat[rows].to(products), wp.T, out=_first(z16_buf, n)))
        elif into_buffers:
            z = torch.matmul(flat[rows].to(products), wp.T, out=_first(z_buf, n))
        else:
            z = head_logits(head, flat[rows], wp)
        p = torch.softmax(z, -1, dtype=torch.float32, out=p_buf[:n])
        if not every_kept:
            # Masked positions learn nothing: filled, not multiplied, so a NaN in a padding state cannot survive.
            dropped = ~keep[rows, None]
            p.masked_fill_(dropped, 0)
        column_sum = p.sum(0)
        if pool is None:
            pool = measured_pool(p, wp, w32, products, policy)
        if sixteen and pool <= 0 and p16_buf is None:
            p16_buf = buffer("p16", products)
        if pool > 0:
            mu = pooled_product(p, wp, w32, pool, column_sum, policy.pool_dense_share)
        elif wp_t is not None and n >= TRANSPOSED_FROM:
            mu = (wp_t @ _first(p16_buf, n).copy_(p).T).T.float()
        else:
            mu = ((_first(p16_buf, n).copy_(p) if sixteen else p) @ wp).float()
        grad = w32[ys[rows]] - mu
        if not every_kept:
            mu.masked_fill_(dropped, 0)
            grad.masked_fill_(dropped, 0)
        grads[rows] = grad
        # float32 sums of at most `chunk` probabilities: ample for a curvature, then summed in float64.
        prob_sum += column_sum.double()
        mean_gram += mu.double().T @ mu.double()
    return grads.reshape(keys.shape), mean_gram, prob_sum

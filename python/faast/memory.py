"""faast.FastWeights: the streaming fast-weight memory.

It never stores keys. It keeps the sufficient statistics S = K^T K [dk, dk], T = K^T diag(s) V [dk, dv], the row
count N and the squared target norm sum ||s v||^2 in float64, so memory is O(d^2) whatever N is, and the solution is
the exact least-squares one over all rows seen (docs/design.md §2). Because the statistics add, merging memories is
addition, unlearning is subtraction, and discounting is a scale.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

import torch

from . import _blend, _persist, ops
from .ops import _validate
from .ops._validate import check_solve_options
from .ops.solve import SolveInfo, float32_cut_warning, solve_fixed_ridge, solve_from_eigh
from .statistics import SummedStatistics

_STATISTICS = ("gram", "cross", "count", "target_sqnorm")
# Configuration that fixes the shape or meaning of the statistics: a file must match it to be loaded into a memory.
_STRUCTURE = ("dim_key", "dim_value", "batch_shape", "mode", "blend_window", "blend_chunk", "weighted_least_squares")


# alpha and ridge: a value, "auto" (chosen by GCV) or None (the configuration's).
_Reg = float | Literal["auto"] | None


class FastWeights(SummedStatistics):
    """Streaming closed-form fast weights W = pinv_eps(K) diag(s) V, with eps = N^-alpha (docs/design.md §1–3).

    Args:
        dim_key: dk, the width of the keys.
        dim_value: dv, the width of the values.
        alpha: spectral filter exponent (keep σ > N^-alpha·σmax), or 'auto' to choose the kept rank by generalized
            cross-validation (GCV) from the statistics alone.
        rtol: a fixed relative cut on singular values instead of N^-alpha.
        ridge: None (truncated pseudo-inverse, the paper's estimator), a penalty μ >= 0 (W = (S + μI)^+ T), or 'auto'
            for the GCV-best μ. Ridge replaces the spectral cut, so alpha is unused with it.
        batch_shape: leading dims of independent memories held together (e.g. (num_layers,)); every update then
            takes keys [*batch_shape, ..., dk].
        discount: γ in (0, 1]: before each update S, T, N (and the GCV statistic) are multiplied by γ, which forgets
            old rows geometrically (0.9 while training a readout). 1 keeps everything.
        prior: a pretrained projection W0 [dk, dv] (or [*batch_shape, dk, dv]), or 'identity' (dk == dv, e.g.
            zero-shot CLIP); with prior_count N0 > 0 the weights are (N0·W0 + N·W*) / (N0 + N).
        prior_count: N0, the pseudo-count of the prior.
        weighted_least_squares: let scores weight whole rows (S = K^T diag(s) K) instead of the values only. A
            different estimator from the authors'; off by default.
        compute_dtype: float64 (default) or float32 to compute each chunk's GEMMs in float32 (summed in float64).
            float32 warns when eps² drops below its resolution, where rank-deficient memories gain false directions.
        drop_nonfinite: drop rows with NaN/Inf (counted in `num_dropped`) instead of raising.
        eager_checks: when `update` validates values (NaN/Inf in learned rows, negative scores). True: at once,
            raising before the memory is touched (a host synchronisation per update). False: on the device, without
            waiting: a memory whose batch fails learns nothing from it and the error is raised by the next solve (see
            `check`). None (default): eager on CPU, deferred on CUDA, where a synchronisation per update stalls the
            GPU pipeline.
        mode: 'exact' (default) or 'blend', the authors' compatibility mode: a window of at most `blend_window` rows
            is solved jointly, and whenever it is full the oldest `blend_chunk` rows are solved alone (eps =
            blend_chunk^-alpha) and blended into a running W0 with weight u / (γ·N0 + u), γ = blend_discount.
            It reproduces their results; it is a different, usually worse, estimator (docs/numerics.md §4).
        dtype: dtype of the returned weights (statistics are always float64).
        device: device of the statistics.

    The memory is an nn.Module so that it moves with its model (`.to(device)`); dtype casts of the model leave the
    float64 statistics alone. Its buffers form its state_dict (in mode='blend' the window's are under `blend.`);
    `save`/`load` write them with the configuration. It is a faast.SummedStatistics: faast.distributed and
    faast.checkpoint find it inside a model, sum it across ranks and save it.
    """

    FORMAT = "faast.FastWeights"
    NONNEGATIVE = ("count", "target_sqnorm", "num_dropped", "blend.sqnorm", "blend.rows", "blend.folded_count")
    # The buffers registered in __init__ (nn.Module resolves them through __getattr__, which types them loosely).
    gram: torch.Tensor
    cross: torch.Tensor
    target_sqnorm: torch.Tensor
    num_dropped: torch.Tensor
    prior: torch.Tensor | None
    _rejected: torch.Tensor

    def __init__(
        self,
        dim_key: int,
        dim_value: int,
        *,
        alpha: float | Literal["auto"] = 1.0,
        rtol: float | None = None,
        ridge: float | Literal["auto"] | None = None,
        batch_shape: Sequence[int] = (),
        discount: float = 1.0,
        prior: torch.Tensor | Literal["identity"] | None = None,
        prior_count: float = 0.0,
        weighted_least_squares: bool = False,
        compute_dtype: torch.dtype = torch.float64,
        drop_nonfinite: bool = False,
        eager_checks: bool | None = None,
        mode: Literal["exact", "blend"] = "exact",
        blend_window: int = 65536,
        blend_chunk: int = 8192,
        blend_discount: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._cache: dict = {}
        self.dim_key = _validate.require_positive_int("dim_key", dim_key)
        self.dim_value = _validate.require_positive_int("dim_value", dim_value)
        self.batch_shape = tuple(_validate.require_positive_int("batch_shape", s) for s in batch_shape)
        check_solve_options(alpha, rtol, ridge, target_sqnorm=True)
        self.alpha, self.rtol, self.ridge = alpha, rtol, ridge
        self.discount = _validate.require_fraction("discount", discount)
        self.prior_count = _validate.require_nonnegative_number("prior_count", prior_count)
        self.weighted_least_squares = bool(weighted_least_squares)
        if compute_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
        self.compute_dtype = compute_dtype
        self.drop_nonfinite = bool(drop_nonfinite)
        if eager_checks is not None and not isinstance(eager_checks, bool):
            raise TypeError(f"eager_checks: expected None, True or False, got {eager_checks!r}")
        self.eager_checks = eager_checks
        if mode not in ("exact", "blend"):
            raise ValueError(f"mode: expected 'exact' or 'blend', got {mode!r}")
        self.mode = mode
        self.blend_window = _validate.require_positive_int("blend_window", blend_window)
        self.blend_chunk = _validate.require_positive_int("blend_chunk", blend_chunk)
        self.blend_discount = _validate.require_fraction("blend_discount", blend_discount)
        if mode == "blend":
            _blend.check_options(self.blend_window, self.blend_chunk, self.discount, self.drop_nonfinite)
        if dtype not in _validate.FLOAT_DTYPES:
            raise TypeError(f"dtype: expected a floating dtype for the weights, got {dtype!r}")
        self.dtype = dtype

        dk, dv, batch = self.dim_key, self.dim_value, self.batch_shape
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        self.register_buffer("gram", torch.zeros((*batch, dk, dk), **f64))
        self.register_buffer("cross", torch.zeros((*batch, dk, dv), **f64))
        self.register_buffer("count", torch.zeros(batch, **f64))
        self.register_buffer("target_sqnorm", torch.zeros(batch, **f64))
        self.register_buffer("num_dropped", torch.zeros(batch, dtype=torch.int64, device=device))
        self.register_buffer(
            "prior", _validate.memory_prior(prior, dim_key=dk, dim_value=dv, batch_shape=batch, device=device)
        )
        if self.prior is None and self.prior_count > 0:
            raise ValueError("prior_count: a positive pseudo-count needs a prior (prior=tensor or 'identity')")
        # Deferred checks (see `check`): per memory, the first rejected update's error code and number, on the device.
        self.register_buffer("_rejected", torch.zeros((*batch, 2), dtype=torch.int64, device=device), persistent=False)
        self._updates = 0
        self.blend: _blend.BlendWindow | None = None
        if mode == "blend":
            self.blend = _blend.BlendWindow(
                dk, dv, batch, window=self.blend_window, chunk=self.blend_chunk, discount=self.blend_discount,
                device=device,
            )  # fmt: skip
            self.blend.reset(self.prior, self.prior_count)
        self._last_info: SolveInfo | None = None
        self._warned_one_off = False
        self._warned_float32 = False

    # ------------------------------------------------------------------ configuration and bookkeeping

    def config(self) -> dict:
        """The constructor arguments (JSON-serialisable) that rebuild this memory, except the prior tensor."""
        return {
            "dim_key": self.dim_key,
            "dim_value": self.dim_value,
            "alpha": self.alpha,
            "rtol": self.rtol,
            "ridge": self.ridge,
            "batch_shape": list(self.batch_shape),
            "discount": self.discount,
            "prior_count": self.prior_count,
            "weighted_least_squares": self.weighted_least_squares,
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "drop_nonfinite": self.drop_nonfinite,
            "eager_checks": self.eager_checks,
            "mode": self.mode,
            "blend_window": self.blend_window,
            "blend_chunk": self.blend_chunk,
            "blend_discount": self.blend_discount,
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    @property
    def solution_key(self) -> tuple:
        """A value that changes whenever `weights` may change: any change of the statistics (in-place edits of the
        buffers included) or of the filter settings (alpha, rtol, ridge). Compare it for equality to cache what is
        derived from the solution."""
        return (*self.state_key, self.alpha, self.rtol, self.ridge)

    def mark_changed(self) -> None:
        """Record a change of the statistics: call it after editing the buffers in place (it bumps `version` and
        drops the cached eigendecomposition and weights)."""
        super().mark_changed()
        self._cache.clear()

    def summed_tensors(self) -> list[torch.Tensor]:
        """S, T, N, the GCV statistic and the dropped-row counts: what faast.distributed sums across ranks."""
        return [self.gram, self.cross, self.count, self.target_sqnorm, self.num_dropped]

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """The prior, if any: configuration that every rank must hold identically."""
        return {} if self.prior is None else {"prior": self.prior}

    def not_summable_reason(self) -> str | None:
        if self.mode != "exact":
            return f"has mode={self.mode!r}; only mode='exact' statistics add across ranks"
        return None

    def extra_repr(self) -> str:
        count = self.count.tolist()
        return (
            f"dim_key={self.dim_key}, dim_value={self.dim_value}, batch_shape={self.batch_shape}, mode={self.mode}, "
            f"alpha={self.alpha}, rtol={self.rtol}, ridge={self.ridge}, count={count}"
        )

    # ------------------------------------------------------------------ saved states (faast.statistics)

    def _current_names(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Files written before the blend window became the submodule `blend` hold its buffers under flat names.
        return {_blend.LEGACY_NAMES.get(name, name): t for name, t in tensors.items()}

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:  # nn.Module's signature
        for old, new in _blend.LEGACY_NAMES.items():
            if prefix + old in state_dict:  # renamed before the submodule `blend` reads its part of state_dict
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _check_structure(self, config: Mapping, tensors: Mapping[str, torch.Tensor], source: object) -> None:
        _persist.check_config(config, self.config(), _STRUCTURE, source, "this memory")
        if ("prior" in tensors) != (self.prior is not None):
            saved = "with" if "prior" in tensors else "without"
            raise ValueError(f"{source}: saved {saved} a prior, this memory differs")

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], source: object) -> None:
        super()._check_tensors(tensors, source)
        if self.blend is not None:
            _blend.check_cursor(tensors["blend.cursor"], self.blend.slots, source)

    @classmethod
    def _from_config(
        cls, config: dict, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None
    ) -> FastWeights:
        config = {**config, "compute_dtype": getattr(torch, config["compute_dtype"]),
                  "dtype": getattr(torch, config["dtype"])}  # fmt: skip
        return cls(**config, prior=tensors.get("prior"), device=device)

    # ------------------------------------------------------------------ learning

    def _checked_rows(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None, *,
        eager: bool,
    ) -> _validate.Rows:  # fmt: skip
        """The door of update and forget: every check of the rows, once (see faast.ops._validate.memory_rows)."""
        blend = self.mode == "blend"
        return _validate.memory_rows(
            keys, values, scores, mask, batch_shape=self.batch_shape, dim_key=self.dim_key, dim_value=self.dim_value,
            device=self.device, drop_nonfinite=self.drop_nonfinite, eager=eager,
            max_abs=_blend.MAX_ABS if blend else None, same_mask=blend,
        )  # fmt: skip

    def _row_counts(self, rows: _validate.Rows) -> torch.Tensor:
        if rows.mask is None:
            return torch.full(self.batch_shape, float(rows.keys.shape[-2]), dtype=torch.float64, device=self.device)
        return rows.mask.sum(-1).to(torch.float64)

    def _statistics(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float64 (dS, dT, dyy) of checked rows; raises, memory untouched, if finite rows overflow float64."""
        statistics = ops.accumulate_gram_unchecked(
            keys, values, scores, mask,
            weighted_least_squares=self.weighted_least_squares, compute_dtype=self.compute_dtype,
        )  # fmt: skip
        _validate.require_finite_statistics(*statistics)
        return statistics

    @torch.no_grad()
    def update(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None, *,
        mask: torch.Tensor | None = None,
    ) -> FastWeights:  # fmt: skip
        """Learn a batch of rows: S += K^T K, T += K^T diag(s) V, N += rows (after the discount, if any).

        Args:
            keys: [*batch_shape, ..., dk]; every dim between the batch dims and dk indexes rows (e.g. [B, T]).
            values: [*batch_shape, ..., dv] with the same row dims.
            scores: [*batch_shape, ...] non-negative weights of the values, or None.
            mask: [*batch_shape, ...] bool; False rows are not learned or counted (padding).

        Returns self. Raises TypeError/ValueError naming the argument on bad input, with the memory untouched.
        """
        rows = self._checked_rows(keys, values, scores, mask, eager=self._checks_eagerly())
        self._updates += 1
        if self.blend is not None:
            window = _blend.WindowSums(self.gram, self.cross, self.count, self.target_sqnorm)
            new = self.blend.update(
                rows, window, statistics=self._statistics, solve=self._solve_statistics,
                options={"alpha": self.alpha, "rtol": self.rtol, "ridge": self.ridge},
            )  # fmt: skip
            for mine, total in zip(window, new, strict=True):
                mine.copy_(total)
        elif rows.rejected is None:
            d_gram, d_cross, d_sqnorm = self._statistics(rows.keys, rows.values, rows.scores, rows.mask)
            if self.discount != 1.0:
                for name in _STATISTICS:
                    getattr(self, name).mul_(self.discount)
            self.gram.add_(d_gram)
            self.cross.add_(d_cross)
            self.target_sqnorm.add_(d_sqnorm)
            self.count.add_(self._row_counts(rows))
        else:
            self._update_deferred(rows)
        self.num_dropped.add_(rows.dropped)
        self.mark_changed()
        return self

    def _checks_eagerly(self) -> bool:
        if self.mode == "blend":
            return True
        return self.device.type != "cuda" if self.eager_checks is None else self.eager_checks

    def _update_deferred(self, rows: _validate.Rows) -> None:
        """update without a host synchronisation: a memory whose batch holds a bad learned row (NaN/Inf, a negative
        score) learns nothing from that batch (decided on the device by the door), and the error is raised by the
        next solve."""
        assert rows.rejected is not None  # for the type checker: update comes here only for rows checked on the device
        ok = rows.rejected == 0
        first = (self._rejected[..., 0] == 0) & ~ok
        self._rejected[..., 0] = torch.where(first, rows.rejected, self._rejected[..., 0])
        self._rejected[..., 1] = torch.where(first, self._updates, self._rejected[..., 1])
        if self.discount != 1.0:  # the discount belongs to the update: a rejected batch leaves the memory as it was
            one = torch.ones(self.batch_shape, dtype=torch.float64, device=self.device)
            gamma = torch.where(ok, one * self.discount, one)  # in float64: a float32 0.9 would drift the counts
            for name in _STATISTICS:
                t = getattr(self, name)
                t.mul_(gamma.reshape(gamma.shape + (1,) * (t.dim() - gamma.dim())))
        ops.accumulate_gram_unchecked(
            rows.keys, rows.values, rows.scores, rows.mask, gram=self.gram, cross=self.cross,
            target_sqnorm=self.target_sqnorm, weighted_least_squares=self.weighted_least_squares,
            compute_dtype=self.compute_dtype,
        )  # fmt: skip
        self.count.add_(self._row_counts(rows))

    def check(self) -> FastWeights:
        """Raise the error a deferred-check update recorded (once; the flag is then cleared). Returns self.

        On CUDA (or with eager_checks=False) `update` validates on the device without waiting for it: a memory whose
        batch holds NaN/Inf in a learned row, or a negative score, learns nothing from that batch, and the error is
        raised here, which every solve calls first. On CPU (eager_checks=None) update raises at once.
        """
        error = _validate.rejected_error(self._rejected, self.batch_shape)
        if error is not None:
            self._rejected.zero_()  # reported once
            raise error
        return self

    def _require_exact(self, what: str) -> None:
        if self.mode != "exact":
            raise ValueError(f"{what}: only defined for mode='exact' (blended chunk solutions do not add)")

    @torch.no_grad()
    def forget(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None, *,
        mask: torch.Tensor | None = None,
    ) -> FastWeights:  # fmt: skip
        """Unlearn rows that were learned before, exactly: S -= K^T K, T -= K^T diag(s) V, N -= rows.

        Exact when the rows were learned with the same scores and no discount was applied since. Raises ValueError
        (memory untouched) if it would take the count below zero. When the count reaches zero the statistics are
        reset to exact zeros, so rounding residue cannot masquerade as data.
        """
        self._require_exact("forget")
        rows = self._checked_rows(keys, values, scores, mask, eager=True)
        removed = self._row_counts(rows)
        remaining = self.count - removed
        if bool((remaining < -1e-9 * removed.clamp_min(1)).any()):
            raise ValueError(
                f"keys: forget would remove {removed.tolist()} rows but the memory holds {self.count.tolist()}; "
                "nothing was forgotten"
            )
        d_gram, d_cross, d_sqnorm = self._statistics(rows.keys, rows.values, rows.scores, rows.mask)
        self.gram.sub_(d_gram)
        self.cross.sub_(d_cross)
        self.target_sqnorm.sub_(d_sqnorm)
        self.count.copy_(remaining.clamp_min(0))
        self._zero_where_empty()
        self.mark_changed()
        return self

    def _zero_where_empty(self) -> None:
        empty = self.count <= 0
        if bool(empty.any()):
            for name in _STATISTICS:
                t = getattr(self, name)
                t.masked_fill_(empty.reshape(empty.shape + (1,) * (t.dim() - empty.dim())), 0)

    @torch.no_grad()
    def merge(self, other: FastWeights) -> FastWeights:
        """Add another memory's statistics (another process, device or task): the result is the union's solution.

        The memories must share dim_key, dim_value, batch_shape, mode='exact' and the score semantics. Priors are
        configuration, not statistics: self's prior is kept.
        """
        if not isinstance(other, FastWeights):
            raise TypeError(f"other: expected a faast.FastWeights, got {type(other).__name__}")
        self._require_exact("merge")
        other._require_exact("merge")
        for field in ("dim_key", "dim_value", "batch_shape", "weighted_least_squares"):
            if getattr(self, field) != getattr(other, field):
                raise ValueError(f"other: expected {field}={getattr(self, field)}, got {getattr(other, field)}")
        for name in (*_STATISTICS, "num_dropped"):
            getattr(self, name).add_(getattr(other, name).to(self.device))
        self.mark_changed()
        return self

    @torch.no_grad()
    def apply_discount(self, gamma: float) -> FastWeights:
        """Multiply S, T, N and the GCV statistic by gamma in (0, 1] now (the constructor's discount does it per
        update)."""
        self._require_exact("apply_discount")
        gamma = _validate.require_fraction("gamma", gamma)
        for name in _STATISTICS:
            getattr(self, name).mul_(gamma)
        self.mark_changed()
        return self

    @torch.no_grad()
    def scale_values(self, factor: float) -> FastWeights:
        """Every value learned so far times factor > 0: T ← factor·T, ‖Y‖² ← factor²·‖Y‖², S and N unchanged, so W*
        becomes factor·W* (GCV picks the same ridge) and the cached eigendecomposition of S is kept (docs/design.md
        §2). TypeError / ValueError for a factor that is not a finite real > 0 or a blend memory, memory untouched."""
        self._require_exact("scale_values")
        factor = _validate.require_nonnegative_number("factor", factor, allow_zero=False)
        spectrum = self._cache.get(("eigh", self.state_key))
        self.cross.mul_(factor)
        self.target_sqnorm.mul_(factor * factor)
        self.mark_changed()
        if spectrum is not None:  # S is untouched: its eigendecomposition still holds
            self._cache[("eigh", self.state_key)] = spectrum
        return self

    @torch.no_grad()
    def reset(self) -> FastWeights:
        """Forget everything: zero statistics and counters (the prior stays)."""
        for name in (*_STATISTICS, "num_dropped", "_rejected"):
            getattr(self, name).zero_()
        if self.blend is not None:
            self.blend.reset(self.prior, self.prior_count)
        self.mark_changed()
        return self

    # ------------------------------------------------------------------ solving

    def _eigh(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("eigh", self.state_key)
        if key not in self._cache:
            lam, vecs = ops.eigh_gram(self.gram)
            self._cache[key] = (lam.reshape(-1, self.dim_key), vecs.reshape(-1, self.dim_key, self.dim_key))
        return self._cache[key]

    def _solve_statistics(
        self, gram: torch.Tensor, cross: torch.Tensor, count: torch.Tensor, sqnorm: torch.Tensor, options: dict
    ) -> tuple[torch.Tensor, SolveInfo]:
        """float64 W* [*batch, dk, dv] of the given statistics; the memory's own are eigendecomposed once. A fixed
        ridge takes a batched Cholesky solve instead, unless the memory's spectrum is already at hand."""
        ridge, dk, dv = options.get("ridge"), self.dim_key, self.dim_value
        fixed = isinstance(ridge, (int, float)) and not isinstance(ridge, bool) and ridge > 0
        if fixed and not (gram is self.gram and ("eigh", self.state_key) in self._cache):
            assert isinstance(ridge, (int, float))  # for the type checker: `fixed` says so
            f64 = count.reshape(-1).to(torch.float64)
            solved = solve_fixed_ridge(gram.reshape(-1, dk, dk), cross.reshape(-1, dk, dv), f64, float(ridge))
            if solved is not None:
                return solved[0].reshape(*self.batch_shape, dk, dv), solved[1].map_tensors(
                    lambda f: f.reshape(self.batch_shape))  # fmt: skip
        if gram is self.gram:
            lam, vecs = self._eigh()
        else:
            lam, vecs = ops.eigh_gram(gram)
            lam, vecs = lam.reshape(-1, self.dim_key), vecs.reshape(-1, self.dim_key, self.dim_key)
        weights, info = solve_from_eigh(
            lam, vecs, cross.reshape(-1, self.dim_key, self.dim_value), count.reshape(-1).to(torch.float64),
            target_sqnorm=sqnorm.reshape(-1), **options,
        )  # fmt: skip
        batch = self.batch_shape
        info = info.map_tensors(lambda f: f.reshape(batch))
        return weights.reshape(*batch, self.dim_key, self.dim_value), info

    def _warn_float32(self, options: dict) -> None:
        quiet = self.compute_dtype != torch.float32 or self._warned_float32  # exact sums, or said once already
        message = None if quiet else float32_cut_warning(options, float(self.count.max()))
        if message is not None:
            self._warned_float32 = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _options(self, alpha: object, rtol: object, ridge: object) -> dict:
        if alpha is None and rtol is None and ridge is None:
            return {"alpha": self.alpha, "rtol": self.rtol, "ridge": self.ridge}
        options = {"alpha": 1.0 if alpha is None else alpha, "rtol": rtol, "ridge": ridge}
        check_solve_options(**options, target_sqnorm=True)
        return options

    @overload
    def solve(
        self, *, alpha: _Reg = ..., rtol: float | None = ..., ridge: _Reg = ..., return_info: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def solve(
        self, *, alpha: _Reg = ..., rtol: float | None = ..., ridge: _Reg = ..., return_info: Literal[True]
    ) -> tuple[torch.Tensor, SolveInfo]: ...
    def solve(
        self, *, alpha: _Reg = None, rtol: float | None = None, ridge: _Reg = None, return_info: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, SolveInfo]:
        """Fast weights [*batch_shape, dk, dv] in `dtype`, solved lazily and cached until the statistics change.

        Without arguments the memory's configuration is used: that is what `weights` returns and what `solve_info`
        describes. Passing any of alpha / rtol / ridge is a one-off solve with exactly those (the others at their
        defaults): it changes neither the configuration nor `weights` / `solve_info` (a UserWarning says so once per
        memory). To keep a filter, set it: `memory.ridge = 'auto'`. The eigendecomposition is shared either way.
        return_info: also return the SolveInfo of this solve.
        """
        configured = alpha is None and rtol is None and ridge is None
        options = self._options(alpha, rtol, ridge)
        if not configured and options != self._options(None, None, None) and not self._warned_one_off:
            self._warned_one_off = True
            warnings.warn(
                f"FastWeights.solve({', '.join(f'{k}={v!r}' for k, v in options.items())}) is a one-off solve: "
                f"memory.weights and memory.solve_info keep the configured filter (alpha={self.alpha!r}, "
                f"rtol={self.rtol!r}, ridge={self.ridge!r}); set memory.alpha / .rtol / .ridge to keep it",
                UserWarning,
                stacklevel=2,
            )
        key = ("weights", self.state_key, tuple(sorted(options.items())))
        if key not in self._cache:
            self.check()
            self._warn_float32(options)
            weights, info = self._solve_statistics(self.gram, self.cross, self.count, self.target_sqnorm, options)
            if self.blend is not None:
                weights = self.blend.blend(weights)
            else:
                weights = self._with_prior(weights, self.count)
            self._cache[key] = (weights.to(self.dtype), info)
        weights, info = self._cache[key]
        if options == self._options(None, None, None):
            self._last_info = info
        return (weights, info) if return_info else weights

    def solve_for(self, cross: torch.Tensor) -> torch.Tensor:
        """W = S_eps^+ T for this memory's S, count and filter but another T: cross [*batch_shape, dk, dv].

        Differentiable in `cross` with S_eps^+ held constant (its eigendecomposition is shared with `solve`): this is
        how a readout and a token scorer are trained through T = K^T diag(s) V (docs/design.md §6.5) without
        an eigensolver backward. Returns float64 weights, blended with the prior like `solve`.
        """
        self._require_exact("solve_for")
        self.check()
        _validate.require_tensor("cross", cross)
        _validate.require_shape("cross", cross, self.cross.shape, "[*batch_shape, dim_key, dim_value]")
        _validate.require_same_device("the memory", self.gram, cross=cross)
        options = self._options(None, None, None)
        weights, _ = self._solve_statistics(self.gram, cross, self.count, self.target_sqnorm, options)
        return self._with_prior(weights, self.count)

    def _with_prior(self, weights: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """(N0·W0 + N·W*) / (N0 + N); W* alone when there is no prior."""
        if self.prior is None or self.prior_count == 0:
            return weights
        n = count.to(torch.float64).reshape(self.batch_shape + (1, 1))
        # lerp is exact at both ends: no rows gives W0 bit for bit.
        return torch.lerp(self.prior, weights, n / (self.prior_count + n))

    @property
    def weights(self) -> torch.Tensor:
        """W [*batch_shape, dk, dv] with the configured filter (see solve)."""
        return self.solve()

    @property
    def solve_info(self) -> SolveInfo | None:
        """Rank, cut, ridge and GCV score of the configured solution, the one `weights` returns (None before it was
        first solved)."""
        return self._last_info

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        """Read the memory: query [*batch_shape, ..., dk] -> query @ W [*batch_shape, ..., dv]."""
        _validate.require_tensor("query", query)
        if query.shape[-1] != self.dim_key:
            raise ValueError(f"query: expected last dim dim_key={self.dim_key}, got shape {list(query.shape)}")
        _validate.require_same_device("the memory", self.gram, query=query)
        weights = self.weights
        dtype = torch.promote_types(query.dtype, weights.dtype)
        if self.batch_shape:
            if tuple(query.shape[: len(self.batch_shape)]) != self.batch_shape:
                raise ValueError(
                    f"query: expected shape [*batch_shape, ..., dim_key] with batch_shape={self.batch_shape}, "
                    f"got {list(query.shape)}"
                )
            rows = query.reshape(*self.batch_shape, -1, self.dim_key)
            return (rows.to(dtype) @ weights.to(dtype)).reshape(*query.shape[:-1], self.dim_value)
        return query.to(dtype) @ weights.to(dtype)

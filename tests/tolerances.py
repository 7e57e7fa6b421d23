"""Every tolerance the test suite uses, declared once (docs/numerics.md §6 explains the numbers)."""

import torch

# Streaming float64 statistics + float64 eigh against the float64 SVD truth on the same keys (docs/numerics.md §1
# measured at most 5.7e-7 / 4.7e-9 over 76 configurations).
TRUTH_REL_W = 1e-5
TRUTH_REL_P = 1e-6

# Sums of the same float64 products in a different order (streaming vs one shot, merge vs union, forget vs never).
REORDER_REL = 1e-12

# Elementwise (atol, rtol) of an op against its float64 oracle, by input dtype. bf16/fp16 inputs are exact after the
# upcast, so their statistics are as exact as float32's; outputs stored in bf16/fp16 carry one rounding.
ELEMENTWISE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 2e-3),
}

# The residual output layer's head products in bfloat16 (logits and p·H rounded to bf16, float32 accumulation):
# relative error of its learned sums (T = Σ h̃ rᵀ, Σ μμᵀ, Σ p) and solved M against float64 or the float32 products on
# the tiny test models (measured 4e-4 to 6e-4).
BF16_HEAD_PRODUCTS_REL = 5e-3

# The head's logits in int8 (ResidualOutput.head_dtype='int8': rows of h̃ and of H each on its own int8 scale, int32
# sums, h̃'s largest columns of a block in float32; p·H float32): relative error of the learned sums and of the
# logits against float64 on the tiny test cases, per kernel (faast.ops.int8). torch._int_mm: measured 4.6e-3 to
# 8.0e-3 (bfloat16 products there 2.6e-3 to 5.7e-3); fbgemm, whose inputs are 7-bit, up to 2.2e-2.
INT8_HEAD_PRODUCTS_REL = 2e-2
INT8_HEAD_PRODUCTS_REL_BY_KERNEL = {"torch.int_mm": INT8_HEAD_PRODUCTS_REL, "torch.fbgemm": 4e-2}

# The step tuned on the held-out logits' change z1 formed in bfloat16 (StepChoice.change_weight) against the
# one tuned on float32 products from the same statistics, and its held-out gain: relative (measured on the tiny llama
# 4e-4; on SmolLM2 at 32K tokens the step moved by 0.06-0.08%).
BF16_CHANGE_STEP_REL = 1e-2

# learn() under bfloat16 autocast (FaastConfig(learn_dtype=)): relative error of the output layer's key Gram against
# the float32 pass's on the tiny test models (the blocks' products round to bfloat16; measured 1.1e-3 to 2.7e-3).
BF16_AUTOCAST_REL = 1e-2

# learn() with the blocks' linears in int8 (FaastConfig(learn_dtype='int8'), 4 float32 input columns of the tiny
# models' 32): relative error of the output layer's key Gram against the float32 pass's, and of one linear (0 or 2
# float32 columns of 12) against its float64 product (measured 2.4e-3 to 9.0e-3).
INT8_PASS_REL = 2e-2

# A whole faast.hf model cast to bfloat16 against the same model in float32, both learning the same tokens: relative
# error of the memories' key Gram and of the logits after learning on the tiny llama (measured 2.1e-3 to 3.6e-3).
BF16_MODEL_REL = 1e-2

# float32 compute mode (per-chunk float32 GEMMs): relative error of S and T against float64.
FLOAT32_COMPUTE_REL = 1e-5

# The lab's exact cache beside FAAST (lab/experiments/lm_suite_cache.py): its mixed NLL, from float32 distances
# (‖q‖² − 2q·k + ‖k‖²) and a float32 softmax, against float64 brute force on the same states (tiny llama and gpt2,
# k 16 and all pairs, T 1 to 30: measured at most 1.6e-7).
CACHE_MIX_REL = 1e-5

# faast.hf.evaluate.token_log_probs (float32 model, right-padded batches) against the model in float64 run on each
# window alone: absolute error of a token's log-probability (tiny llama and gpt2, with and without a context:
# measured at most 3.7e-7).
SCORE_LOG_PROB_ABS = 1e-5

# Generalized cross-validation: the RSS formula against a direct fit, and the grid search against a brute-force one.
GCV_RSS_REL = 1e-9
GCV_SEARCH_REL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F in float64 (0 when both are zero)."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)  # a number: no graph (hooked activations)
    denom = b.norm()
    if denom == 0:
        return float((a - b).norm())
    return float((a - b).norm() / denom)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = ELEMENTWISE[dtype]
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), atol=atol, rtol=rtol)


# Triton Gram kernel, float32-accumulating modes ("tf32x3", "fp32"): relative error of S and T against float64.
TRITON_FP32_MODE_REL = 1e-5
# "exact16" with scores: s·v is split into two 16-bit terms, ~16 significant bits per factor (2^-16 ≈ 1.5e-5 per
# element, more relative to a norm that cancels).
TRITON_EXACT16_SCORED_REL = 1e-4
# torch.exact16 (faast.ops.gram_modes): exact 16-bit products summed in float32 over R rows, then in float64, so it
# is float32-grade like the float32 compute mode; scaled rows (scores, weighted least squares) are split into two
# 16-bit terms as in the Triton kernel (measured 2.4e-6 for bf16 with scores).
EXACT16_REL = FLOAT32_COMPUTE_REL
EXACT16_SCORED_REL = TRITON_EXACT16_SCORED_REL

# faast.hf: statistics of the same text learned with left vs right padding. The hidden states come from float32
# attention over differently laid-out masks, so they agree to float32 rounding, not bit for bit.
HF_PADDING_REL = 1e-5

# LM evaluation: float32 forward passes of the same tokens laid out differently (a cached prefix vs one sequence, a
# context row vs a concatenation), compared in float64 log-probabilities.
LM_LAYOUT_ABS = 1e-4

# A fixed ridge μ solved by Cholesky against the eigh path when S has null directions (rank-deficient keys): the eigh
# path drops them, Cholesky divides T's rounding there by μ; relative difference in units of 2^-52·λmax/μ (measured
# at most 2.2 over 48 cases, tests/test_cholesky_solve.py).
CHOLESKY_NULL_DIRECTIONS = 8.0

# The step's 1-D search (faast.hf.output.tuning.tune_step_rows) against a brute-force grid of the same float64 NLL:
# it stops once the next point moves η by under STEP_TOL (1%), where the NLL is quadratic, so its η lies within a few
# STEP_TOL of the grid's best and its NLL just above the best's (measured at most 0.6% and 1.3e-5 nats on the
# synthetic held-out rows of tests/test_step_search.py).
STEP_SEARCH_REL = 0.03
STEP_SEARCH_NLL_ABS = 1e-4

# The tuned step when the same texts are learned in another order: the same held-out rows and float64 statistics,
# summed in another order (float32 products of the tail's rows), so the steps differ by rounding alone.
ORDER_STEP_REL = 1e-6
# ... where the tuning's change z1 is formed in bfloat16 (head_dtype 'auto' on a CPU with native bfloat16): the
# statistics' rounding now flips a few bfloat16 roundings of the change and of z1. Measured 1.05e-5 on the json +
# licence order case at 2 AMD EPYC cores with native bfloat16 (tests/test_hf_smollm2.py).
ORDER_STEP_REL_BF16_CHANGE = 1e-4

# The residual output layer's held-out NLL at a tuned (η, λ) (float32 logits of float16-stored keys, summed in float64)
# against a float64 hand computation from the same stored keys, on the tiny test models.
HELD_OUT_NLL_REL = 1e-5

# faast.ops.refined_eigh (eigh's torch.refined: float32 eigh + Ogita–Aishima refinement), tests/test_refined_eigh.py.
# Eigenpairs: residual ‖AE − EΛ‖_F in units of d·2^-52·‖A‖_F and orthogonality ‖EᵀE − I‖_F in units of d·2^-52, the
# grade its own final check enforces (refined_eigh.CHECK_C). Measured on the test's matrices (d = 60 to 257): refined
# at most 0.18 and 0.39, LAPACK's float64 eigh 0.10 and 0.97 (each measure carries its own product's rounding).
EIGH_PAIR_UNITS = 4.0
# max |λ − λ_LAPACK| (eigvalsh) in units of d·2^-52·‖A‖_2: measured at most 0.15 for refined, and 0.14 for float64
# eigh's own eigenvalues (computed with the vectors, another path through LAPACK).
EIGH_VALUE_UNITS = 1.0
# Fast weights from the refined pairs against float64 eigh's, relative (Frobenius), where float64 eigh's own W is
# determined to that accuracy: the kept spectrum's κ·2^-52 at most W_DETERMINED_KAPPA_U, 100x below REFINED_W_REL
# (two float64 eighs, of S and of a permuted S, measured W apart by 0.2 to 1.0 times κ·2^-52). Measured refined vs
# float64 eigh where determined: at most 1.1e-14.
REFINED_W_REL = 1e-10
W_DETERMINED_KAPPA_U = 1e-12
# Elsewhere (κ·2^-52 up to 2.3e-10 for the power-law spectra, 2e-4 for λ from 1 to 1e-12), against an exact truth
# (an S with exact float64 eigenpairs): refined W's error at most this factor times float64 eigh's own, plus this.
# Measured ratio 0.12 to 0.77 (errors 2.3e-13 to 5.7e-6 refined, 8.7e-13 to 1.7e-5 float64 eigh).
REFINED_W_TRUTH_FACTOR = 2.0
REFINED_W_TRUTH_ABS = 1e-12

# faast.ops.int8.int8_linear against the float64 product, per kernel, on the tests' rows (37 x 45 with two channels
# 12-20x the others, outlier columns 0-7, and all-large rows of one sign): torch._int_mm's 8-bit rows and weights
# measured at most MEASURED_INT_MM; fbgemm's 7-bit rows (reduce_range), twice the step, at most MEASURED_FBGEMM.
INT8_LINEAR_REL = {"torch.int_mm": 2e-2, "torch.fbgemm": 4e-2}

# faast_kernels.gram_int8 against float64: entrywise |error| <= rows·(plan bound + INT8_SLICE_ROUNDING)·2^(E_i+E_j)
# (2^E_j: the power of two above column j's max |x|). The plan's bound is the slices' own (below 2^-53 per row); this
# term covers the float64 additions, the kernel's (chunk sums, one per pair weight: at most 9 per chunk) and the
# float64 reference's (rows-long sums: about rows·2^-53 per row at the tests' at most 60 rows), with margin. A
# float32-grade sum (2^-24 per row) fails it by a factor of 2^20.
INT8_SLICE_ROUNDING = 2.0**-44

# The document folds' key sums (float32 products per batch, summed in float64; faast/hf/document_folds.py) against the
# memory's own sums of the same positions, or another model's that learned just those documents (measured 1.1e-7).
DOCUMENT_FOLDS_REL = 1e-5

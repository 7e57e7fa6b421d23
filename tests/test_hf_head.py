"""faast.hf.output.head.head_gradients against a float64 hand computation: r = H[y] − softmax(h̃Hᵀ + b)·H, Σ μμᵀ and
Σ p over the learned positions, for every path through it (own logits into reused buffers, a head with a bias, logits
given by a stream, masked positions, several chunks with a ragged last one, bfloat16 products, p·H with pooled
columns)."""

from __future__ import annotations

import pytest
import torch

from faast.hf import OutputPolicy
from faast.hf.output import head as head_module
from tolerances import BF16_HEAD_PRODUCTS_REL, FLOAT32_COMPUTE_REL, assert_close, rel

VOCAB, DIM = 97, 24
POOL_ALWAYS = OutputPolicy(pool_dense_share=1.0)  # pool however few columns fall below the threshold


def reference(head: torch.nn.Linear, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):  # noqa: ANN201
    weight = head.weight.double()
    logits = keys.double() @ weight.T
    if head.bias is not None:
        logits = logits + head.bias.double()
    p = torch.softmax(logits, -1) * mask.unsqueeze(-1)
    mu = p @ weight
    grads = (weight[targets] - mu) * mask.unsqueeze(-1)
    flat_mu = mu.reshape(-1, DIM)
    return grads, flat_mu.T @ flat_mu, p.reshape(-1, VOCAB).sum(0)


def case(bias: bool, masked: bool, rows: int = 23):  # noqa: ANN201
    g = torch.Generator().manual_seed(7 + bias + 2 * masked)
    head = torch.nn.Linear(DIM, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, DIM, generator=g) / 2)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g))
    keys = torch.randn(2, rows, DIM, generator=g)
    targets = torch.randint(0, VOCAB, (2, rows), generator=g)
    mask = torch.ones(2, rows, dtype=torch.bool)
    if masked:
        mask[0, :5] = False
        mask[1, -3:] = False
        keys[0, 0] = float("nan")  # a masked position's key must not reach the learned sums
    return head, keys, targets, mask


@pytest.mark.parametrize("masked", [False, True], ids=["all-learned", "masked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_match_float64(monkeypatch, bias, masked, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)  # 46 positions: 5 full chunks of 8 and a ragged 6
    head, keys, targets, mask = case(bias, masked)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    expected = reference(head, clean, targets, mask)
    grads, mean_gram, prob_sum = head_module.head_gradients(head, keys, targets, mask, torch.float32)
    assert grads.dtype == torch.float32 and mean_gram.dtype == prob_sum.dtype == torch.float64
    assert bool(torch.isfinite(grads).all())
    assert_close(grads, expected[0], torch.float32)
    assert_close(mean_gram, expected[1], torch.float32)
    assert_close(prob_sum, expected[2], torch.float32)
    assert bool((grads[~mask] == 0).all())


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_from_given_logits_match_float64(monkeypatch, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    head, keys, targets, mask = case(bias=True, masked=True)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    logits = (clean.double() @ head.weight.double().T + head.bias.double()).float()
    expected = reference(head, clean, targets, mask)
    # The keys are ignored for the logits when they are given: poison them.
    got = head_module.head_gradients(head, torch.full_like(keys, 1e6), targets, mask, torch.float32, logits)
    for actual, want in zip(got, expected, strict=True):
        assert_close(actual, want, torch.float32)


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_in_bfloat16_products_stay_close(monkeypatch, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    head, keys, targets, mask = case(bias=False, masked=True)
    expected = reference(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask)
    got = head_module.head_gradients(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask, torch.bfloat16)
    for actual, want in zip(got, expected, strict=True):
        assert rel(actual, want) < BF16_HEAD_PRODUCTS_REL


def test_head_gradients_of_no_positions():
    head, keys, targets, mask = case(bias=False, masked=False)
    grads, mean_gram, prob_sum = head_module.head_gradients(
        head, keys[:, :0], targets[:, :0], mask[:, :0], torch.float32
    )
    assert grads.shape == (2, 0, DIM)
    assert bool((mean_gram == 0).all()) and bool((prob_sum == 0).all())


def pooled_reference(head: torch.nn.Linear, keys, targets, mask, pool: float, chunk: int):  # noqa: ANN001, ANN201
    """The float64 hand computation of pooled p·H: per block of `chunk` flattened positions, the columns whose
    probability is below `pool` in every learned row are replaced by their mean row of H, weighted by the block's
    summed probabilities, at each row's pooled mass."""
    weight = head.weight.double()
    flat, ys, keep = keys.reshape(-1, DIM).double(), targets.reshape(-1), mask.reshape(-1)
    logits = flat.masked_fill(~keep[:, None], 0) @ weight.T
    if head.bias is not None:
        logits = logits + head.bias.double()
    p = torch.softmax(logits, -1) * keep[:, None]
    mus, pooled_columns = [], 0
    for i in range(0, flat.shape[0], chunk):
        block = p[i : i + chunk]
        kept = block.amax(0) >= pool
        mu = block[:, kept] @ weight[kept]
        rest = block[:, ~kept]
        if (~kept).any():
            mu = mu + rest.sum(1, keepdim=True) * (rest.sum(0) @ weight[~kept] / rest.sum())
        mus.append(mu)
        pooled_columns += int((~kept).sum())
    mu = torch.cat(mus)
    grads = (weight[ys] - mu) * keep[:, None]
    return grads.reshape(*keys.shape), mu.T @ mu, p.sum(0), pooled_columns


def peaked_case(bias: bool = False):  # noqa: ANN201
    """A head whose last 40 tokens are improbable at every position (their logits 7.5 lower), so that they and a few
    more stay below a pool of 1e-2 in a block (43 of 97 columns over all learned positions without a bias)."""
    head, keys, targets, mask = case(bias=bias, masked=True)
    with torch.no_grad():
        keys[..., 1] = 3.0
        head.weight[-40:, 1] -= 2.5
    return head, keys, targets, mask


@pytest.mark.parametrize("path", ["own-logits", "bias", "given-logits"])
@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_with_pooled_columns_match_a_float64_hand_pooling(monkeypatch, chunk, path):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    head, keys, targets, mask = peaked_case(bias=path == "bias")
    *expected, pooled_columns = pooled_reference(head, keys, targets, mask, 1e-2, chunk)
    assert pooled_columns > 0
    logits = None
    if path == "given-logits":  # a stream passes the logits it scored; the keys then only carry the mask's NaN
        logits = (keys.masked_fill(~mask.unsqueeze(-1), 0).double() @ head.weight.double().T).float()
    got = head_module.head_gradients(head, keys, targets, mask, torch.float32, logits, pool=1e-2, policy=POOL_ALWAYS)
    for actual, want in zip(got, expected, strict=True):
        assert_close(actual, want, torch.float32)
    assert bool((got[0][~mask] == 0).all())
    # Pooling moves each row's μ but not their sum: Σ r over the learned positions is the exact one.
    exact = reference(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask)
    assert rel(got[0].sum((0, 1)), exact[0].sum((0, 1))) < FLOAT32_COMPUTE_REL
    assert rel(got[0], exact[0]) > 10 * FLOAT32_COMPUTE_REL  # and the rows did move: the pooled path was taken


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_pooled_head_gradients_in_bfloat16_products_err_only_by_the_products_rounding(monkeypatch, chunk):
    """'auto' pools bfloat16 products on a CPU: the kept columns' product rounds to bfloat16, the pooled row stays
    float32. Against the float64 pooled reference, every sum errs no more than the exact bfloat16 products err
    against the exact float64 reference on the same (peaked, so larger-logit) case: pooling adds no error of its
    own."""
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    pooled_calls = []
    pooled_product = head_module.pooled_product

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        pooled_calls.append(1)
        return pooled_product(*args, **kwargs)

    monkeypatch.setattr(head_module, "pooled_product", spy)
    head, keys, targets, mask = peaked_case()
    *expected, pooled_columns = pooled_reference(head, keys, targets, mask, 1e-2, chunk)
    assert pooled_columns > 0
    got = head_module.head_gradients(head, keys, targets, mask, torch.bfloat16, pool=1e-2, policy=POOL_ALWAYS)
    assert pooled_calls  # the pooled path was taken, not the exact one
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    exact = reference(head, clean, targets, mask)
    exact_bf16 = head_module.head_gradients(head, clean, targets, mask, torch.bfloat16)
    for actual, want, products, truth in zip(got, expected, exact_bf16, exact, strict=True):
        assert rel(actual, want) <= 1.25 * rel(products, truth) + FLOAT32_COMPUTE_REL
        assert rel(actual, want) < 2 * BF16_HEAD_PRODUCTS_REL
    assert bool((got[0][~mask] == 0).all())


def test_pooled_rows_err_by_at_most_their_pooled_mass_times_the_pooled_rows_spread():
    head, keys, targets, mask = peaked_case()
    flat = keys.reshape(-1, DIM)[mask.reshape(-1)]
    weight = head.weight.detach()
    p = torch.softmax(flat @ weight.T, -1)
    mu = head_module.pooled_product(p, weight, weight, 1e-2)
    exact = p.double() @ weight.double()
    kept = p.amax(0) >= 1e-2
    assert 0 < int((~kept).sum()) < VOCAB
    mass = p[:, ~kept].double().sum(1)
    mean = p[:, ~kept].double().sum(0) @ weight[~kept].double() / p[:, ~kept].double().sum()
    spread = (weight[~kept].double() - mean).norm(dim=1).max()
    err = (mu.double() - exact).norm(dim=1)
    assert bool((err <= mass * spread * (1 + 1e-4) + 1e-5).all())
    assert float(err.max()) > 0


def test_pooling_keeps_the_full_product_when_most_columns_are_kept():
    head, keys, targets, mask = case(bias=False, masked=False)  # soft predictions: every column above 1e-4 somewhere
    exact = head_module.head_gradients(head, keys, targets, mask, torch.float32)
    pooled = head_module.head_gradients(head, keys, targets, mask, torch.float32, pool=1e-4)
    for a, b in zip(pooled, exact, strict=True):
        assert torch.equal(a, b)


def test_pool_threshold_auto_is_measured_on_a_cpu_and_pools_float32_products_elsewhere():
    keys32, keys64 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)
    off_cpu = torch.empty(2, 4, device="meta")  # stands in for a GPU: only the device type is read
    assert head_module.pool_threshold("auto", torch.float32, keys32) is None  # head_gradients times it (CPU)
    assert head_module.pool_threshold("auto", torch.bfloat16, keys32) is None
    assert head_module.pool_threshold("auto", torch.float32, off_cpu) == OutputPolicy().pool_auto
    assert head_module.pool_threshold("auto", torch.bfloat16, off_cpu) == 0.0
    assert head_module.pool_threshold("auto", torch.float32, keys64) == 0.0
    assert head_module.pool_threshold("auto", torch.bfloat16, keys64) == 0.0
    assert head_module.pool_threshold(0.0, torch.float32, keys32) == 0.0
    assert head_module.pool_threshold(3e-4, torch.bfloat16, keys64) == 3e-4


def test_kept_head_buffers_are_shared_by_the_calls_inside_and_give_what_fresh_ones_give(monkeypatch):
    monkeypatch.setattr(head_module, "READ_CHUNK", 8)
    head, keys, targets, mask = case(bias=False, masked=True)
    other = torch.randn(2, 3, DIM, generator=torch.Generator().manual_seed(5))
    fresh = [head_module.head_gradients(head, k, targets[:, : k.shape[1]], mask[:, : k.shape[1]], products)
             for k, products in ((keys, torch.bfloat16), (other, torch.bfloat16), (keys, torch.float32))]  # fmt: skip
    buffers = head_module.HeadBuffers()
    seen = []
    get = buffers.get

    def spy(name, *args):  # noqa: ANN001, ANN002, ANN202
        out = get(name, *args)
        seen.append((name, out.data_ptr()))
        return out

    monkeypatch.setattr(buffers, "get", spy)
    with buffers.kept():
        # 46 rows in chunks of 8, then 6 (a slice of the same buffers, holding the first call's values), then float32.
        for (k, products), want in zip(((keys, torch.bfloat16), (other, torch.bfloat16), (keys, torch.float32)), fresh,
                                       strict=True):  # fmt: skip
            got = head_module.head_gradients(head, k, targets[:, : k.shape[1]], mask[:, : k.shape[1]], products,
                                             buffers=buffers)  # fmt: skip
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
        # z, p and their 16-bit copies, 8 rows each, and H in bfloat16 (the float32 H is the head's own weight).
        assert buffers.held_bytes() == 8 * VOCAB * (4 + 4 + 2 + 2) + VOCAB * DIM * 2
    assert buffers.held_bytes() == 0
    pointers = {}
    for name, ptr in seen:
        pointers.setdefault(name, set()).add(ptr)
    assert set(pointers) == {"z", "p", "z16", "p16"} and all(len(p) == 1 for p in pointers.values())


def test_pooling_adds_no_error_to_bfloat16_products_beyond_their_own(monkeypatch):
    """On sharp predictions the bfloat16 products' own rounding is already above BF16_HEAD_PRODUCTS_REL for Σμμᵀ
    (6.3e-3): pooled, each output errs against the float64 pooling by at most 10% more than exact bfloat16 products
    err against the float64 products."""
    monkeypatch.setattr(head_module, "READ_CHUNK", 8)
    head, keys, targets, mask = peaked_case()
    *pooled64, pooled_columns = pooled_reference(head, keys, targets, mask, 1e-2, 8)
    assert pooled_columns > 0
    exact64 = reference(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask)
    exact16 = head_module.head_gradients(head, keys, targets, mask, torch.bfloat16)
    pooled16 = head_module.head_gradients(head, keys, targets, mask, torch.bfloat16, pool=1e-2, policy=POOL_ALWAYS)
    for got, want, own, truth in zip(pooled16, pooled64, exact16, exact64, strict=True):
        assert rel(got, want) <= 1.1 * rel(own, truth)


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_bfloat16_p_h_through_the_transposed_head_matches_float64(monkeypatch, chunk):
    """From TRANSPOSED_FROM rows a block's 16-bit p·H is (Hᵀ pᵀ)ᵀ: here every block takes it (46 rows in one block,
    or blocks of 8 and a ragged 6), and the outputs stay as close to float64 as the direct product's. A doubled Hᵀ
    doubles every μ, so μ does come from it."""
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    monkeypatch.setattr(head_module, "TRANSPOSED_FROM", 4)
    head, keys, targets, mask = case(bias=False, masked=True)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    expected = reference(head, clean, targets, mask)
    got = head_module.head_gradients(head, clean, targets, mask, torch.bfloat16)
    for actual, want in zip(got, expected, strict=True):
        assert rel(actual, want) < BF16_HEAD_PRODUCTS_REL
    weight = head_module.HeadBuffers.weight

    def doubled(self, w, dtype, transposed=False):  # noqa: ANN001, ANN202
        out = weight(self, w, dtype, transposed)
        assert not transposed or (out.shape == (DIM, VOCAB) and out.is_contiguous() and out.dtype == torch.bfloat16)
        return 2 * out if transposed else out

    monkeypatch.setattr(head_module.HeadBuffers, "weight", doubled)
    marked = head_module.head_gradients(head, clean, targets, mask, torch.bfloat16)
    assert rel(marked[1], 4 * expected[1]) < BF16_HEAD_PRODUCTS_REL  # Σ μμᵀ of 2μ
    assert rel(marked[2], expected[2]) < BF16_HEAD_PRODUCTS_REL  # Σ p does not pass through H


def test_kept_buffers_cast_the_head_once_and_again_after_it_changes(monkeypatch):
    monkeypatch.setattr(head_module, "TRANSPOSED_FROM", 4)
    head, keys, targets, mask = case(bias=False, masked=True)
    buffers = head_module.HeadBuffers()
    assert buffers.weight(head.weight, torch.float32) is head.weight  # already float32: itself, never held
    with buffers.kept():
        first = [buffers.weight(head.weight, torch.bfloat16, t) for t in (False, True)]
        again = [buffers.weight(head.weight, torch.bfloat16, t) for t in (False, True)]
        assert all(a is b for a, b in zip(first, again, strict=True))
        assert torch.equal(first[1], head.weight.T.bfloat16())
        assert buffers.held_bytes() == 2 * VOCAB * DIM * 2
        with torch.no_grad():
            head.weight.mul_(0.5)  # changed in place: the casts must follow
        got = head_module.head_gradients(head, keys, targets, mask, torch.bfloat16, buffers=buffers)
        fresh = head_module.head_gradients(head, keys, targets, mask, torch.bfloat16)
        for a, b in zip(got, fresh, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(buffers.weight(head.weight, torch.bfloat16, True), head.weight.T.bfloat16())
        casts = buffers.held_bytes() - 46 * VOCAB * (4 + 4 + 2 + 2)
        assert casts == 2 * VOCAB * DIM * 2  # the old version's casts were dropped, not kept beside the new
    assert buffers.held_bytes() == 0

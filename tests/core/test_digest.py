"""Gradient digests (nanreplay.core.digest) and the reproduction verdict read from them
(nanreplay.engine.compare): what a bundle keeps of a gradient instead of its values."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanreplay.core.digest import GradDigest, digest_of, grad_absmax, grads_nonfinite, maybe_digest
from nanreplay.engine.compare import common_factor, compare_grads

NAN, INF = float("nan"), float("inf")


def _grad(seed: int = 0, shape=(6, 5)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_counts_norms_and_masks_of_a_partly_non_finite_gradient():
    g = _grad()
    g[0, 1], g[2, 2], g[3, 0], g[5, 4] = NAN, INF, -INF, 0.0
    d = digest_of(g)
    fin = g[torch.isfinite(g)].double()
    assert (d.dtype, d.shape, d.nan, d.posinf, d.neginf) == ("float32", (6, 5), 1, 1, 1)
    assert d.nonzero == int((fin != 0).sum()) == 26
    assert d.sum == pytest.approx(float(fin.sum()), rel=1e-12)
    assert d.norm == pytest.approx(float(fin.norm()), rel=1e-12)
    assert d.absmax == pytest.approx(float(fin.abs().max()))
    # one packed-bit mask per kind present in some but not all elements, 30 elements -> 4 bytes
    assert sorted(d.masks) == ["nan", "neginf", "posinf"]
    assert all(m.dtype == torch.uint8 and m.shape == (4,) for m in d.masks.values())
    bits = [(int(d.masks["nan"][i // 8]) >> (7 - i % 8)) & 1 for i in range(30)]
    assert bits == torch.isnan(g).reshape(-1).int().tolist()
    assert d.nonfinite == 3 and grads_nonfinite({"w": d}) and not grads_nonfinite({"w": digest_of(_grad())})


def test_an_all_nan_gradient_keeps_counts_only():
    d = digest_of(torch.full((1000,), NAN))
    assert d.nan == 1000 and d.masks == {} and d.sumsq == 0.0 and d.absmax == 0.0


def test_the_hash_reads_values_not_nan_payloads_or_signed_zeros():
    g = _grad()
    g[1, 1] = NAN
    other = g.clone()
    other.view(torch.int32)[1, 1] = 0x7FC00001  # another NaN bit pattern
    assert torch.isnan(other[1, 1])
    assert digest_of(g).same_values(digest_of(other))
    z = torch.zeros(3)
    assert digest_of(z).same_values(digest_of(-z))
    moved = g.clone()
    moved[0, 0] = torch.nextafter(moved[0, 0], torch.tensor(INF))  # one ulp
    assert digest_of(g).same_pattern(digest_of(moved)) and not digest_of(g).same_values(digest_of(moved))
    shifted = g.clone()
    shifted[1, 1], shifted[1, 2] = g[1, 2], NAN  # the NaN one place over
    assert not digest_of(g).same_pattern(digest_of(shifted))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.complex64])
def test_an_all_zero_gradient_hashes_as_its_zero_bytes(dtype):
    z = torch.zeros(7, 3, dtype=dtype)
    z[0, 0] = -0.0
    d = digest_of(z)
    assert d.nonzero == 0 and d.sha256 == hashlib.sha256(bytes(z.numel() * z.element_size())).hexdigest()
    with_nan = z.clone()
    with_nan[1, 1] = NAN  # a NaN hashes as 0 too
    assert digest_of(with_nan).sha256 == d.sha256 and not digest_of(with_nan).same_pattern(d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_other_dtypes(dtype):
    g = _grad().to(dtype)
    g[0, 0] = NAN
    d = digest_of(g)
    assert d.dtype == str(dtype).removeprefix("torch.") and d.shape == (6, 5)
    assert d.nan == 1  # complex: counted on the real view, where NaN + 0j is one NaN and one zero
    assert d.numel == (60 if dtype.is_complex else 30)
    assert d.same_values(digest_of(g.clone()))
    with pytest.raises(TypeError, match="floating or complex"):
        digest_of(torch.arange(3))


def test_empty_gradient():
    d = digest_of(torch.empty(0, 4))
    assert (d.nan, d.nonzero, d.sumsq, d.masks) == (0, 0, 0.0, {}) and d.same_values(digest_of(torch.empty(0, 4)))


def test_meta_round_trip():
    g = _grad()
    g[2, 3] = -INF
    d = digest_of(g)
    back = GradDigest.from_meta(d.to_meta(), d.masks)
    assert back.same_values(d) and back.to_meta() == d.to_meta()


def test_maybe_digest_keeps_whole_finite_gradients_in_auto():
    finite = {"a": _grad(1), "b": _grad(2)}
    assert all(isinstance(v, torch.Tensor) for v in maybe_digest(finite, "auto").values())
    assert all(isinstance(v, GradDigest) for v in maybe_digest(finite, "digest").values())
    bad = {"a": _grad(1), "b": torch.full((3,), NAN)}
    assert all(isinstance(v, GradDigest) for v in maybe_digest(bad, "auto").values())
    assert all(isinstance(v, torch.Tensor) for v in maybe_digest(bad, "full").values())
    # a non-finite loss with finite gradients (NaN over no targets, zero gradients): the replay recomputes them
    assert all(isinstance(v, GradDigest) for v in maybe_digest(finite, "auto", loss_nonfinite=True).values())
    assert all(isinstance(v, torch.Tensor) for v in maybe_digest(finite, "full", loss_nonfinite=True).values())
    assert grad_absmax(maybe_digest(finite, "digest")["a"]) == pytest.approx(float(finite["a"].abs().max()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 3e38, NAN, INF, -INF]), min_size=1, max_size=40),
       st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 3e38, NAN, INF, -INF]), min_size=1, max_size=40))
def test_digests_agree_exactly_when_the_tensors_compare_equal(a, b):
    """The digest verdicts match compare_grads on whole tensors: same pattern, and bit-equal
    finite values (a NaN's payload and a zero's sign aside)."""
    x, y = torch.tensor(a), torch.tensor(b)
    if x.numel() != y.numel():
        y = torch.cat([y, x])[: x.numel()]
    dx, dy = digest_of(x), digest_of(y)
    whole = compare_grads({"w": x}, {"w": y})
    digested = compare_grads({"w": dx}, {"w": y})
    assert dx.same_pattern(dy) == (torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(torch.isposinf(x), torch.isposinf(y))
                                   and torch.equal(torch.isneginf(x), torch.isneginf(y)))
    assert (whole["verdict"] == "reproduced exactly") == (digested["verdict"] == "reproduced exactly")
    assert whole["verdict"] == digested["verdict"] or whole.get("grad_factor") is not None or digested.get("grad_factor") is not None


def test_compare_grads_on_digests():
    rec = {"w": _grad(1), "b": _grad(2, (5,))}
    rec["w"][0, 0] = NAN
    digests = maybe_digest(rec, "digest")
    exact = compare_grads(digests, {k: v.clone() for k, v in rec.items()})
    assert exact["verdict"] == "reproduced exactly" and exact["max_abs_diff"] == 0.0
    close = {k: v.clone() for k, v in rec.items()}
    close["b"][0] += 0.25
    r = compare_grads(digests, close)
    assert r["verdict"] == "reproduced" and r["max_abs_diff"] is None
    assert 0.0 < r["norm_diff"] <= 0.25 + 1e-9 and "store_grads='full'" in r["detail"]
    finite = {k: torch.nan_to_num(v) for k, v in rec.items()}
    assert compare_grads(digests, finite)["verdict"] == "not reproduced"
    assert compare_grads(digests, {"b": rec["b"]})["verdict"] == "not reproduced"  # w's NaN gradient absent


def test_common_factor_on_digests():
    """clip_grad_norm_ after backward: the recorded gradients are the replayed ones times one factor."""
    replayed = {"w": _grad(3), "b": _grad(4, (5,))}
    recorded = {k: v * 0.125 for k, v in replayed.items()}
    c = common_factor(maybe_digest(recorded, "digest"), replayed)
    assert c == pytest.approx(0.125, rel=1e-6)
    assert common_factor(maybe_digest({k: -v for k, v in recorded.items()}, "digest"), replayed) == pytest.approx(-0.125, rel=1e-6)
    r = compare_grads(maybe_digest(recorded, "digest"), replayed)
    assert r["verdict"] == "reproduced" and r["grad_factor"] == pytest.approx(0.125, rel=1e-6)
    # a NaN total norm turned every recorded gradient NaN; the replay holds the NaN that caused it
    nan_rec = {k: torch.full_like(v, NAN) for k, v in replayed.items()}
    bad = {k: v.clone() for k, v in replayed.items()}
    bad["b"][2] = INF
    assert math.isnan(common_factor(maybe_digest(nan_rec, "digest"), bad))
    # two different factors: none
    mixed = {"w": replayed["w"] * 0.5, "b": replayed["b"] * 0.25}
    assert common_factor(maybe_digest(mixed, "digest"), replayed) is None


@pytest.mark.parametrize("kind", ["digest", "full"])
def test_gradients_that_differ_by_rounding_show_no_common_factor(kind):
    """A compiled recording replayed eagerly: every gradient within float32 rounding of the
    replay's (here each value moved by a few units in the last place, as another summation order
    moves it), which is no rescale by the loop; a real rescale close to 1 still is one."""
    replayed = {"w": _grad(5), "b": _grad(6, (5,))}
    noise = torch.Generator().manual_seed(7)
    rounded = {k: v * (1 + 3e-7 * torch.randn(v.shape, generator=noise)) for k, v in replayed.items()}
    assert common_factor(maybe_digest(rounded, kind), replayed) is None
    r = compare_grads(maybe_digest(rounded, kind), replayed)
    assert r["verdict"] == "reproduced" and "grad_factor" not in r and "rescaled" not in r["detail"]
    clipped = {k: v * 0.999 for k, v in replayed.items()}  # clip_grad_norm_ just below the norm
    assert common_factor(maybe_digest(clipped, kind), replayed) == pytest.approx(0.999, rel=1e-6)

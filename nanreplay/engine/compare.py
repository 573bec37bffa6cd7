"""The reproduction verdict: does the replay produce what the recording holds?

Compared per gradient: the same non-finite positions (NaN, +Inf, -Inf) and the max abs difference
of the finite values; a recorded non-finite loss that replays finite (or the reverse) is not
reproduced; a loop that rescaled every gradient after backward (``clip_grad_norm_``) is found by
:func:`common_factor`.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional, Union

import torch

from ..core.digest import GradDigest, RecordedGrad, digest_of, grads_nonfinite, is_digest
from ..core.jsonable import fnum
from ..core.numerics import any_nonfinite, as_real, is_float

__all__ = ["VERDICTS", "compare_grads", "common_factor", "compare_loss", "compare_outside", "Outside"]

VERDICTS = ("reproduced exactly", "reproduced", "not reproduced", "not replayed")


def compare_grads(recorded: Mapping[str, RecordedGrad], replayed: dict[str, torch.Tensor]) -> dict:
    """Compare gradients: same non-finite positions (NaN, +Inf, -Inf) and the max abs
    difference of the finite values. Verdict: ``reproduced exactly`` (same pattern, finite values
    bit-equal), ``reproduced`` (the replay is non-finite where the recording was, within a max abs
    difference), ``not reproduced`` (the replay's gradients are finite, or differ in which
    parameters are non-finite).

    A recorded gradient kept as a :class:`~nanreplay.core.digest.GradDigest` is compared with the
    replayed one's digest: the pattern from the counts and packed positions, bit-equality from
    the hashes. Its finite values are not kept, so where they differ ``max_abs_diff`` is
    ``None`` and ``norm_diff`` gives the largest difference of the finite 2-norms (a lower bound
    of the 2-norm of the difference)."""
    if not recorded:
        return {"verdict": "not reproduced", "max_abs_diff": None, "detail": "the bundle holds no recorded gradients to compare"}
    t = _Tally()
    for name, r in recorded.items():
        t.add(name, r, replayed.get(name))
    exact, max_diff, mismatched, missing, rec_bad, rep_bad, norm_diff = (
        t.exact, t.max_diff, t.mismatched, t.missing, t.rec_bad, t.rep_bad, t.norm_diff)
    detail = []
    if missing:
        detail.append(f"{len(missing)} recorded gradient(s) absent in the replay, e.g. {missing[:3]}")
    if mismatched:
        detail.append(f"non-finite positions differ in {len(mismatched)} tensor(s), e.g. {mismatched[:3]}")
    if not rep_bad and rec_bad:
        verdict = "not reproduced"
        detail.insert(0, "the replayed gradients are all finite")
    elif rec_bad and not rec_bad <= rep_bad:
        verdict = "not reproduced"
        detail.insert(0, f"recorded non-finite gradients in {sorted(rec_bad - rep_bad)[:3]} are finite or absent in the replay")
    elif exact:
        verdict = "reproduced exactly"
    else:
        verdict = "reproduced"
    if norm_diff is not None:
        detail.append(f"finite values differ; the bundle keeps gradient digests, not values: their finite 2-norms differ by up to "
                      f"{_g(norm_diff)} (record with store_grads='full' for the exact differences)")
    factor = None if exact or missing else common_factor(recorded, replayed, replayed_digests=t.replay_digests)
    if factor is not None:
        # the loop rescaled every gradient between backward and optimizer.step()
        verdict = "reproduced"
        detail = [
            f"the recorded gradients are the replayed ones times one factor {_g(factor)}: the training loop rescaled "
            "them after backward (clip_grad_norm_, whose NaN or Inf total norm turns every gradient NaN; or a loss "
            "divided outside the loss function, e.g. for gradient accumulation)"
        ]
    out = {
        "verdict": verdict,
        "max_abs_diff": fnum(max_diff) if norm_diff is None else None,
        "nonfinite_recorded": len(rec_bad),
        "nonfinite_replayed": len(rep_bad),
        "detail": "; ".join(detail),
    }
    if norm_diff is not None:
        out["norm_diff"] = fnum(norm_diff)
    if factor is not None:
        out["grad_factor"] = fnum(factor)
    return out


class _Tally:
    """What :func:`compare_grads` gathers over the gradients, one :meth:`add` each."""

    def __init__(self) -> None:
        self.exact, self.max_diff = True, 0.0
        self.mismatched: list[str] = []
        self.missing: list[str] = []
        self.rec_bad: set[str] = set()
        self.rep_bad: set[str] = set()
        self.norm_diff: Optional[float] = None  # set when a digest's finite values differ from the replay's
        self.replay_digests: dict[str, GradDigest] = {}  # the replayed gradients compared with recorded digests

    def add(self, name: str, r: RecordedGrad, g: Optional[torch.Tensor]) -> None:
        if g is None:
            self.missing.append(name)
            self.exact = False
            if grads_nonfinite([r]):
                self.rec_bad.add(name)  # a non-finite gradient the replay never produced is not reproduced
            return
        if not is_digest(r) and not is_float(r):
            return
        if grads_nonfinite([r]):
            self.rec_bad.add(name)
        if is_digest(r):
            rg = self.replay_digests[name] = digest_of(g) if is_float(g) else None
            replay_bad = rg is not None and rg.nonfinite > 0
            same_pattern, d = _digest_diff(r, rg)
        else:
            replay_bad = any_nonfinite(g)
            same_pattern, d = _tensor_diff(r, g)
        if replay_bad:
            self.rep_bad.add(name)
        if isinstance(d, tuple):  # a digest whose finite values differ: the norms' difference
            self.norm_diff, d = max(self.norm_diff or 0.0, d[1]), None
        else:
            self.max_diff = max(self.max_diff, d)
        if not same_pattern:
            self.mismatched.append(name)
        if not same_pattern or d != 0.0:
            self.exact = False


def _tensor_diff(r: torch.Tensor, g: torch.Tensor) -> tuple[bool, float]:
    """(same NaN/+Inf/-Inf positions, max abs difference of the finite values) of a recorded
    and a replayed gradient."""
    r, g = as_real(r.to(g.device)), as_real(g)
    same_pattern = (
        torch.equal(torch.isnan(r), torch.isnan(g)) and torch.equal(torch.isposinf(r), torch.isposinf(g)) and torch.equal(torch.isneginf(r), torch.isneginf(g))
    )
    fin = torch.isfinite(r) & torch.isfinite(g)
    return same_pattern, float((r[fin].double() - g[fin].double()).abs().max()) if fin.any() else 0.0


def _digest_diff(r: GradDigest, rg: Optional[GradDigest]) -> tuple[bool, Union[float, tuple[None, float]]]:
    """As :func:`_tensor_diff` for a recorded digest and the replayed gradient's (``None`` for a
    non-floating one): the difference is 0.0 when the finite values hash the same, else unknown,
    given as ``(None, |recorded 2-norm - replayed 2-norm|)``."""
    if rg is None:
        return False, (None, r.norm)
    return r.same_pattern(rg), 0.0 if r.same_values(rg) else (None, abs(r.norm - rg.norm))


class Outside(NamedTuple):
    """A recorded gradient against a replayed one, outside the elements the recording holds
    non-finite (:func:`compare_outside`)."""

    bit_equal: bool   # every element the recording holds finite is bit-equal in the replay (and finite there)
    recorded_nonfinite: int  # elements the recording holds NaN/Inf at
    replay_finite_there: int  # of those, the ones the replay holds finite


def compare_outside(recorded: RecordedGrad, replayed: torch.Tensor) -> Outside:
    """Does the replay reproduce a recorded gradient everywhere but where the recording holds
    NaN/Inf? Whole tensors are compared element by element; a recorded
    :class:`~nanreplay.core.digest.GradDigest` by the hash of the replayed values with the
    recording's non-finite positions zeroed (the digest's hash zeroes them too): the recording
    kept no value there. ``-0.0`` and ``0.0`` count as equal, as in the digest. One copy of the
    gradient."""
    g = as_real(replayed.detach()).reshape(-1)
    if is_digest(recorded):
        where = recorded.nonfinite_positions()
        where = where.to(g.device) if where is not None else torch.zeros(g.numel(), dtype=torch.bool, device=g.device)
        if where.numel() != g.numel():
            return Outside(False, int(where.sum()), 0)
        vals = g.clone()
        vals[where] = 0
        finite_elsewhere = bool(torch.isfinite(vals).all())
        same = finite_elsewhere and digest_of(vals).sha256 == recorded.sha256
    else:
        r = as_real(recorded.detach().to(g.device)).reshape(-1)
        if r.numel() != g.numel():
            return Outside(False, 0, 0)
        where = ~torch.isfinite(r)
        keep = ~where
        same = bool(torch.isfinite(g[keep]).all()) and torch.equal(r[keep], g[keep])
    n = int(where.sum())
    return Outside(same, n, int(torch.isfinite(g[where]).sum()) if n else 0)


def _g(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else repr(x)


#: relative tolerance of a common factor on whole gradients (float32 rounding of ``c * g``)
FACTOR_RTOL = 4e-6
#: the same on digests (finite 2-norms and sums, accumulated in float64 from float32 values)
FACTOR_RTOL_DIGEST = 1e-5


def common_factor(recorded: Mapping[str, RecordedGrad], replayed: dict[str, torch.Tensor], *,
                  replayed_digests: Optional[Mapping[str, GradDigest]] = None) -> Optional[float]:
    """The one scalar ``c`` (not 1) with ``recorded == c * replayed`` for every gradient, within
    float32 rounding and with the same NaN/Inf pattern, or ``None``. A ``c`` within that tolerance
    of 1 is ``None`` too: gradients that differ by rounding (a compiled recording replayed eagerly,
    another summation order) are no evidence of a rescale. ``c`` is NaN when every
    recorded value is NaN and the replay holds a non-finite value (``clip_grad_norm_`` with a
    NaN total norm), 0 for an Inf total norm. Needs two finite non-zero values to infer a finite
    ``c``; one tensor at a time, no copy of all gradients. Recorded digests are matched on their
    finite sums and 2-norms (``c`` from the ratio of the norms, its sign from the sums);
    ``replayed_digests``: digests of ``replayed`` already computed (:func:`compare_grads` has them)."""
    names = [n for n, r in recorded.items() if is_digest(r) or is_float(r)]
    if not names or any(n not in replayed for n in names):
        return None
    if any(is_digest(recorded[n]) for n in names):
        return _digest_factor({n: recorded[n] if is_digest(recorded[n]) else digest_of(recorded[n]) for n in names},
                              {n: replayed[n] for n in names}, dict(replayed_digests or {}))
    return _tensor_factor([(as_real(recorded[n].detach().to(replayed[n].device)).double(), as_real(replayed[n].detach()).double()) for n in names])


def _tensor_factor(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Optional[float]:
    """:func:`common_factor` on whole (recorded, replayed) gradient pairs, as float64."""
    c, best, usable = None, 0.0, 0
    for r, g in pairs:
        ok = torch.isfinite(r) & torch.isfinite(g) & (g != 0)
        usable += int(ok.sum())
        if ok.any():
            i = int(torch.where(ok, g.abs(), torch.zeros_like(g)).argmax())
            if abs(float(g.reshape(-1)[i])) > best:
                best, c = abs(float(g.reshape(-1)[i])), float(r.reshape(-1)[i] / g.reshape(-1)[i])
    if c is None:
        all_nan = all(bool(torch.isnan(r).all()) for r, _ in pairs)
        some_bad = any_nonfinite([g for _, g in pairs])
        return math.nan if all_nan and some_bad else None
    if usable < 2 or abs(c - 1.0) <= FACTOR_RTOL:
        return None
    for r, g in pairs:
        e = g * c
        if not (torch.equal(torch.isnan(r), torch.isnan(e)) and torch.equal(torch.isposinf(r), torch.isposinf(e)) and torch.equal(torch.isneginf(r), torch.isneginf(e))):
            return None
        fin = torch.isfinite(r)
        if fin.any() and float((r[fin] - e[fin]).abs().max()) > FACTOR_RTOL * float(r[fin].abs().max()) + 1e-30:
            return None
    return c


def _digest_factor(recorded: dict[str, GradDigest], replayed: dict[str, torch.Tensor], known: dict[str, GradDigest]) -> Optional[float]:
    """:func:`common_factor` on digests: every tensor's finite 2-norm scaled by one ``|c|`` and its
    finite sum by one ``c`` (relative tolerance 1e-5), the same non-finite pattern in ``c *
    replayed``, and at least two finite non-zero values. ``known``: replayed digests already
    computed, by FQN."""
    c: Optional[float] = None
    for n, r in recorded.items():
        g = replayed[n]
        if r.nan == r.numel and r.numel and any_nonfinite(g):
            continue
        if c is None and r.nonzero:
            gd = known.get(n) or digest_of(g)
            if gd.norm == 0:
                return None
            c = math.copysign(r.norm / gd.norm, r.sum * gd.sum if gd.sum else 1.0)
    if c is None:
        every_nan = all(r.nan == r.numel for r in recorded.values())
        return math.nan if every_nan and any_nonfinite(list(replayed.values())) else None
    if abs(c - 1.0) <= FACTOR_RTOL_DIGEST or sum(r.nonzero for r in recorded.values()) < 2:
        return None
    for n, r in recorded.items():
        e = digest_of(replayed[n].double() * c)
        if not r.same_pattern(e):
            return None
        if not (math.isclose(r.norm, e.norm, rel_tol=FACTOR_RTOL_DIGEST, abs_tol=1e-30)
                and math.isclose(r.sum, e.sum, rel_tol=FACTOR_RTOL_DIGEST, abs_tol=1e-7 * math.sqrt(r.numel) * r.norm + 1e-30)):
            return None
    return c


def compare_loss(repro: dict, recorded: Optional[float], replayed: list[float]) -> None:
    """Fold the loss into the verdict: a recorded non-finite loss that replays finite (or the
    reverse) means the failure was not reproduced, whatever the gradients say.

    ``replayed`` holds one value per micro-batch. A loop under gradient accumulation may log only
    the last micro-batch's loss, or their sum or mean: the recorded value is compared with each of
    those, and agrees when one of them has its finiteness (and its value, within float32 rounding,
    when both are finite)."""
    if recorded is None or not replayed:
        return
    repro["loss_recorded"] = fnum(recorded)
    total = math.fsum(replayed) if all(math.isfinite(v) for v in replayed) else sum(replayed)
    candidates = {"the last micro-batch's": replayed[-1], "the sum of the micro-batches'": total, "the mean of the micro-batches'": total / len(replayed)}
    rec_bad = not math.isfinite(recorded)

    def agrees(v: float) -> bool:
        if rec_bad or not math.isfinite(v):
            return rec_bad == (not math.isfinite(v))
        return abs(v - recorded) <= 1e-3 * max(abs(v), abs(recorded)) + 1e-6

    if any(agrees(v) for v in candidates.values()):
        return
    rep_bad = any(not math.isfinite(v) for v in replayed)
    if rec_bad != rep_bad:
        repro["verdict"] = "not reproduced"
        msg = f"recorded loss {recorded} but the replayed loss is {'non-finite' if rep_bad else 'finite'}"
        repro["detail"] = msg + ("; " + repro["detail"] if repro.get("detail") else "")

"""The reproduction verdict: does the replay produce what the recording holds?

Compared per gradient: the same non-finite positions (NaN, +Inf, -Inf) and the max abs difference
of the finite values; a recorded non-finite loss that replays finite (or the reverse) is not
reproduced; a loop that rescaled every gradient after backward (``clip_grad_norm_``) is found by
:func:`common_factor`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.jsonable import fnum
from ..core.numerics import any_nonfinite, as_real, is_float

__all__ = ["VERDICTS", "compare_grads", "common_factor", "compare_loss"]

VERDICTS = ("reproduced exactly", "reproduced", "not reproduced", "not replayed")


def compare_grads(recorded: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> dict:
    """Compare gradients: same non-finite positions (NaN, +Inf, -Inf) and the max abs
    difference of the finite values. Verdict: ``reproduced exactly`` (same pattern, finite values
    bit-equal), ``reproduced`` (the replay is non-finite where the recording was, within a max abs
    difference), ``not reproduced`` (the replay's gradients are finite, or differ in which
    parameters are non-finite)."""
    if not recorded:
        return {"verdict": "not reproduced", "max_abs_diff": None, "detail": "the bundle holds no recorded gradients to compare"}
    exact, max_diff, mismatched, missing = True, 0.0, [], []
    rec_bad, rep_bad = set(), set()
    for name, r in recorded.items():
        g = replayed.get(name)
        if g is None:
            missing.append(name)
            exact = False
            if any_nonfinite(r):
                rec_bad.add(name)  # a non-finite gradient the replay never produced is not reproduced
            continue
        r = r.to(g.device)
        if not is_float(r):
            continue
        r, g = as_real(r), as_real(g)
        if any_nonfinite(r):
            rec_bad.add(name)
        if any_nonfinite(g):
            rep_bad.add(name)
        same_pattern = (
            torch.equal(torch.isnan(r), torch.isnan(g)) and torch.equal(torch.isposinf(r), torch.isposinf(g)) and torch.equal(torch.isneginf(r), torch.isneginf(g))
        )
        fin = torch.isfinite(r) & torch.isfinite(g)
        d = float((r[fin].double() - g[fin].double()).abs().max()) if fin.any() else 0.0
        max_diff = max(max_diff, d)
        if not same_pattern:
            mismatched.append(name)
        if not same_pattern or d != 0.0:
            exact = False
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
    factor = None if exact or missing else common_factor(recorded, replayed)
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
        "max_abs_diff": fnum(max_diff),
        "nonfinite_recorded": len(rec_bad),
        "nonfinite_replayed": len(rep_bad),
        "detail": "; ".join(detail),
    }
    if factor is not None:
        out["grad_factor"] = fnum(factor)
    return out


def _g(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else repr(x)


def common_factor(recorded: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]) -> Optional[float]:
    """The one scalar ``c`` (not 1) with ``recorded == c * replayed`` for every gradient, within
    float32 rounding and with the same NaN/Inf pattern, or ``None``. ``c`` is NaN when every
    recorded value is NaN and the replay holds a non-finite value (``clip_grad_norm_`` with a
    NaN total norm), 0 for an Inf total norm. Needs two finite non-zero values to infer a finite
    ``c``; one tensor at a time, no copy of all gradients."""
    names = [n for n, r in recorded.items() if is_float(r)]
    if not names or any(n not in replayed for n in names):
        return None
    pairs = [(as_real(recorded[n].detach().to(replayed[n].device)).double(), as_real(replayed[n].detach()).double()) for n in names]
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
    if usable < 2 or c == 1.0:
        return None
    for r, g in pairs:
        e = g * c
        if not (torch.equal(torch.isnan(r), torch.isnan(e)) and torch.equal(torch.isposinf(r), torch.isposinf(e)) and torch.equal(torch.isneginf(r), torch.isneginf(e))):
            return None
        fin = torch.isfinite(r)
        if fin.any() and float((r[fin] - e[fin]).abs().max()) > 4e-6 * float(r[fin].abs().max()) + 1e-30:
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

"""The rollback plan in words: one phrase for the plan and one for its non-finite episode, the
same in the Recorder's messages (``capture``) and in the reports (``report``). Plain data in,
strings out; the plan's fields are documented in ``docs/report.md`` (``rollback``) and built by
:meth:`nanreplay.capture.recorder.Recorder.rollback_plan`."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["episode_phrase", "plan_phrase", "restore_phrase", "skip_phrase", "span"]


def span(first: int, last: int) -> str:
    """``120..123``, or ``120`` for one step."""
    return f"{first}..{last}" if last > first else f"{first}"


def skip_phrase(first: int, last: int) -> str:
    """``the batches of steps 120..123``, or ``the batch of step 120`` for one step."""
    return f"the batches of steps {span(first, last)}" if last > first else f"the batch of step {first}"


def episode_phrase(ep: dict) -> str:
    """A plan's ``episode`` in words: ``4 consecutive non-finite steps 120..123 (gradients,
    update skipped), weights untouched by non-finite values since step 120``."""
    first, last, count = ep["first_step"], ep["last_step"], ep["steps"]
    runs = ep.get("runs") or []
    parts = "; ".join((f"{span(r['first'], r['last'])}: " if len(runs) > 1 else "") + f"{r['nonfinite']}, update {r['update']}"
                      for r in runs)
    head = (f"{count} consecutive non-finite step{'s' if count > 1 else ''} {span(first, last)}" if count == last - first + 1
            else f"{count} non-finite steps in {span(first, last)}")
    corrupted = ep.get("weights_corrupted_at")
    tail = (f"the weights took a non-finite update at step {corrupted}" if corrupted is not None
            else f"weights untouched by non-finite values since step {first}")
    return f"{head} ({parts}), {tail}" if parts else f"{head}, {tail}"


def restore_phrase(plan: dict) -> str:
    """Where the plan restores: ``restore step 100 (checkpoint ckpt-100)``, ``restore step 120
    (snapshot)``, or why nothing can be restored."""
    if plan.get("restore_step") is None:
        return plan.get("note") or "no healthy state held (set snapshot_every, or register checkpoints with note_checkpoint)"
    where = plan.get("source") or "?"
    if plan.get("path"):
        where += f" {plan['path']}"
    return f"restore step {plan['restore_step']} ({where})"


def plan_phrase(plan: Optional[dict[str, Any]]) -> str:
    """The whole plan in one line: where to restore, the batches to skip, the episode, the learning
    rate jump in force, and the checkpoints refused (every one, with why)."""
    if not plan or plan.get("step") is None:
        return "no alarm: nothing to roll back"
    first, last = plan["first_abnormal_step"], plan["step"]
    parts = [restore_phrase(plan), f"skip {skip_phrase(first, last)}"]
    jump = plan.get("lr_jump")
    if jump:
        parts.append(f"the learning rate jumped to {jump['lr']:.4g} at step {jump['step']} (from {jump['previous']:.4g}): restart "
                     "below it")
    if plan.get("episode"):
        parts.append(episode_phrase(plan["episode"]))
    refused = [r for r in plan.get("rejected") or [] if r.get("source") == "checkpoint"]
    if refused:
        parts.append("not a restore point: " + "; ".join(
            f"checkpoint of step {r['step']}" + (f" ({r['path']})" if r.get("path") else "") + f": {r['why']}" for r in refused))
    return ", ".join(parts[:2]) + "".join(f"; {p}" for p in parts[2:])

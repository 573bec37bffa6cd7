"""The non-finite episode, the checkpoints registered, and which saved states are healthy.

A rollback plan is only as good as the state it restores. :class:`EpisodeLog` keeps what the
Recorder learns about that, step by step, on the host (O(1) per step, no device work):

* **the current non-finite episode** (:class:`Episode`): its first non-finite step (the loss or
  the unscaled gradients), every step in it as runs ``[first, last, what, update]`` (complete,
  however long: contiguous steps with the same facts share one run), whether each step's update
  was ``"applied"`` (``action="warn"``), ``"skipped"`` (``raise``, ``skip``), ``"skipped by the
  scaler"`` (a GradScaler skipped the optimizer step) or ``"undone"`` (``check_update`` put the
  pre-step state back), the consecutive count, and the first step whose update was applied with
  non-finite values (the weights' corruption). An episode stays open across at most
  :data:`EPISODE_GAP` finite steps; the next non-finite step after that opens a new one. A
  GradScaler's routine skips (an overflow at a large, falling scale) are no episode: they are
  kept as a run of steps (two ints), discarded at the next finite step; when the scaler's failure
  is declared right after them (the scale reached its floor, or the loss is non-finite), they
  are the episode's first steps: the episode starts where the non-finite values started, not
  where the Recorder gave up.
* **the corruption windows**: an update applied with non-finite values at step ``c`` makes the
  step-start state of every step after ``c`` non-finite, until :meth:`EpisodeLog.rolled_back`
  (the Recorder put a healthy snapshot back) or a checkpoint registered with finite weights
  (the weights were restored some other way). Weights already non-finite when the Recorder
  attached (``meta["attach_scan"]``) open a window from the start.
* **the checkpoints registered** (:meth:`EpisodeLog.note_checkpoint`): the step whose step-start
  state the checkpoint holds, its path, and whether the weights and optimizer state were finite
  when it was registered (``Recorder.note_checkpoint``: one fused norm and one host read at that
  call; the Recorder checks it, it does not assume it). About 100 bytes of host memory each; all
  are kept.

:meth:`EpisodeLog.why_unhealthy` is the one rule of a restore point: the state of step ``s``
(a held snapshot or a checkpoint) is healthy when ``s`` is no later than the first abnormal step
(its state precedes the first update made with non-finite or abnormal values), lies in no
corruption window, and, for a checkpoint, was checked finite when registered; a checkpoint step
only reported (``extra_meta["last_checkpoint_step"]``, unchecked) is accepted only where the
Recorder's own checks cover it (saved after the Recorder attached, in no corruption window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Episode", "EpisodeLog", "EPISODE_GAP", "UPDATES"]

#: finite steps that end an episode (a non-finite one here, a spike episode in capture.early)
EPISODE_GAP = 5

#: what became of a non-finite step's update
UPDATES = ("applied", "skipped", "skipped by the scaler", "undone")


@dataclass
class Episode:
    """One non-finite episode, as the rollback plan and the report show it.

    Attributes:
        first_step, last_step: its first and latest non-finite step.
        runs: ``[first, last, nonfinite, update]`` lists, oldest first, covering every non-finite
            step of the episode: ``nonfinite`` says what was non-finite (``"loss"``,
            ``"gradients"``, ``"gradients and loss"``, ``"update"``, ``"values on another rank"``),
            ``update`` what became of the step's update (one of :data:`UPDATES`).
        count: non-finite steps in it. consecutive: non-finite steps in a row up to the latest
            step checked (0 after a finite step). corrupted_at: the first step whose update was
            applied with non-finite values, else ``None``.
    """

    first_step: int
    last_step: int
    runs: list = field(default_factory=list)
    count: int = 0
    consecutive: int = 0
    corrupted_at: Optional[int] = None

    def add(self, first: int, last: int, what: str, update: str) -> None:
        """Steps ``first..last``, non-finite alike (O(1): a run continues when the facts are the same)."""
        prev = self.runs[-1] if self.runs else None
        if prev is not None and prev[1] >= first:  # the same step found twice (the update check after the check): keep the latest
            prev[2], prev[3] = what, update
            return
        n = last - first + 1
        self.consecutive = self.consecutive + n if prev is not None and prev[1] == first - 1 and self.consecutive else n
        if prev is not None and prev[1] == first - 1 and prev[2] == what and prev[3] == update:
            prev[1] = last
        else:
            self.runs.append([first, last, what, update])
        self.last_step = last
        self.count += n

    def to_json(self) -> dict:
        """The episode as the plan holds it (``docs/report.md``, ``rollback.episode``)."""
        return {"first_step": self.first_step, "last_step": self.last_step, "steps": self.count, "consecutive": self.consecutive,
                "runs": [{"first": a, "last": b, "nonfinite": w, "update": u} for a, b, w, u in self.runs],
                "weights_corrupted_at": self.corrupted_at}


class EpisodeLog:
    """The Recorder's record of non-finite episodes, corruption windows and registered checkpoints.

    Args:
        attach_step: the step the Recorder attached at (``step_offset``).
        attach_clean: the weights and buffers were finite at attach (``meta["attach_scan"]``).

    Attributes:
        current: the latest episode (open while no more than :data:`EPISODE_GAP` finite steps
            followed it), else ``None``.
        checkpoints: ``{"step", "path", "finite"}`` per checkpoint registered, oldest first
            (``finite``: checked when registered).
        corrupted: ``[start, end]`` windows: the step-start state of a step ``s`` with
            ``start < s < end`` held non-finite values (``end`` ``None``: still open).
    """

    def __init__(self, attach_step: int, attach_clean: bool = True) -> None:
        self.attach_step = attach_step
        self.current: Optional[Episode] = None
        self.checkpoints: list[dict] = []
        self.corrupted: list[list] = [] if attach_clean else [[attach_step - 1, None]]
        self._routine: Optional[list[int]] = None  # [first, last]: a GradScaler's routine skips in a row, not (yet) an episode

    # -- per step ----------------------------------------------------------------------------
    def nonfinite(self, step: int, what: str, update: str, *, corrupts: bool = False) -> Episode:
        """Record a non-finite step: ``what`` was non-finite, ``update`` became of its update
        (:data:`UPDATES`), ``corrupts``: that update was applied with non-finite values. The
        routine scaler skips just before it (:meth:`routine_skip`) become the episode's first
        steps. Returns the episode it belongs to. O(1)."""
        ep = self.current
        routine = self._routine if self._routine is not None and self._routine[1] == step - 1 else None
        self._routine = None
        first = routine[0] if routine else step
        if ep is None or first - ep.last_step > EPISODE_GAP + 1:
            ep = self.current = Episode(first_step=first, last_step=first)
        if routine:
            ep.add(routine[0], routine[1], "gradients", "skipped by the scaler")
        ep.add(step, step, what, update)
        if corrupts:
            if ep.corrupted_at is None:
                ep.corrupted_at = step
            if not self.weights_corrupted:
                self.corrupted.append([step, None])
        return ep

    def routine_skip(self, step: int) -> None:
        """A GradScaler's routine skip (an overflow at a large, falling scale): not an alarm; it
        joins an episode in progress, else waits: the next finite step discards it, a failure
        right after it makes it the failure's first step. O(1)."""
        ep = self.current
        if ep is not None and ep.consecutive and ep.last_step == step - 1:
            ep.add(step, step, "gradients", "skipped by the scaler")
        elif self._routine is not None and self._routine[1] == step - 1:
            self._routine[1] = step
        else:
            self._routine = [step, step]

    def finite(self) -> None:
        """A step checked finite: the consecutive count is over; routine skips are discarded. O(1)."""
        self._routine = None
        if self.current is not None:
            self.current.consecutive = 0

    def episode_at(self, step: int) -> Optional[Episode]:
        """The current episode when ``step`` belongs to it or follows it within
        :data:`EPISODE_GAP` finite steps, else ``None``."""
        ep = self.current
        if ep is None or step < ep.first_step or step - ep.last_step > EPISODE_GAP:
            return None
        return ep

    @property
    def consecutive(self) -> int:
        """Non-finite steps in a row up to the latest step checked."""
        return self.current.consecutive if self.current is not None else 0

    @property
    def weights_corrupted(self) -> bool:
        """Whether the live weights took a non-finite update that nothing has undone since."""
        return bool(self.corrupted) and self.corrupted[-1][1] is None

    @property
    def corrupted_since(self) -> Optional[int]:
        """The step whose non-finite update the live weights still carry, else ``None``."""
        return self.corrupted[-1][0] if self.weights_corrupted else None

    # -- states that can be restored ---------------------------------------------------------
    def note_checkpoint(self, step: int, path: Optional[str], finite: bool, *, now: int) -> dict:
        """Register a checkpoint holding the step-start state of ``step``, checked ``finite``
        when registered (at step ``now``). A finite one closes an open corruption window (the
        weights were restored some other way). Returns the entry."""
        entry = {"step": int(step), "path": None if path is None else str(path), "finite": bool(finite)}
        self.checkpoints = [c for c in self.checkpoints if (c["step"], c["path"]) != (entry["step"], entry["path"])]
        self.checkpoints.append(entry)
        if finite and self.weights_corrupted:
            self.corrupted[-1][1] = now
        return entry

    def rolled_back(self, now: int) -> None:
        """A healthy state was put back before step ``now``: the corruption window closes there."""
        if self.weights_corrupted:
            self.corrupted[-1][1] = now

    def why_unhealthy(self, step: int, *, first_abnormal: Optional[int], finite: Optional[bool] = True) -> Optional[str]:
        """Why the step-start state of ``step`` is not a restore point, else ``None`` (the rule
        of the module's docstring). ``finite``: what the check said of it when it was saved
        (``None``: never checked, a checkpoint step only reported)."""
        if first_abnormal is not None and step > first_abnormal:
            return f"saved after the first abnormal step {first_abnormal}"
        for start, end in self.corrupted:
            if start < step and (end is None or step < end):
                return (f"saved after the non-finite update of step {start}" if start >= self.attach_step
                        else "the weights were non-finite when the Recorder attached")
        if finite is False:
            return "its weights or optimizer state were non-finite when it was registered"
        if finite is None and step < self.attach_step:
            return f"saved before the Recorder attached at step {self.attach_step}: its weights were never checked"
        return None

    def checkpoint_options(self, extra_meta: dict) -> list[dict]:
        """The checkpoints: those registered, and ``extra_meta["last_checkpoint_step"]`` when it
        is not one of them (reported, never checked: ``finite`` ``None``)."""
        out = list(self.checkpoints)
        legacy = extra_meta.get("last_checkpoint_step")
        if isinstance(legacy, int) and not isinstance(legacy, bool) and all(c["step"] != legacy for c in out):
            out.append({"step": legacy, "path": None, "finite": None})
        return out

    def restore_point(self, snapshots: list[int], extra_meta: dict, *, first_abnormal: Optional[int]) -> dict:
        """The latest held snapshot or checkpoint that :meth:`why_unhealthy` accepts (a snapshot
        before a checkpoint of the same step: it is restored in process).

        Returns:
            ``{"restore_step", "source", "path", "rejected"}``: ``rejected`` lists every state
            newer than the one chosen that was refused, newest first, each ``{"step", "source",
            "path", "why"}``.
        """
        options = [(s, 1, "snapshot", None, True) for s in set(snapshots)]
        options += [(c["step"], 0, "checkpoint", c["path"], c["finite"]) for c in self.checkpoint_options(extra_meta)]
        rejected: list[dict] = []
        for step, _, source, path, finite in sorted(options, key=lambda o: (o[0], o[1]), reverse=True):
            why = self.why_unhealthy(step, first_abnormal=first_abnormal, finite=finite)
            if why is None:
                return {"restore_step": step, "source": source, "path": path, "rejected": rejected}
            rejected.append({"step": step, "source": source, "path": path, "why": why})
        return {"restore_step": None, "source": None, "path": None, "rejected": rejected}

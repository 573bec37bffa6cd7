"""One-process replay of a sharded run (FSDP2, tensor parallel): the ranks' bundles put together.

Each rank of a sharded run writes its own bundle (:mod:`nanreplay.capture.sharded`): its local
shards of the weights, optimizer state and gradients, their layout (global shape, placements,
mesh, offsets) in ``meta.distributed.sharding``, a ``run_id`` and the file names of its
``siblings``. :func:`find_run` finds the siblings of a run (a directory, one rank's bundle, or
several named bundles) and checks they belong together; :func:`merge_run` writes one bundle with
the full parameters and optimizer state, the origin rank's batch, RNG states and cotangents, and
the gradients put together from the shards (the reduced gradients: their non-finite positions are
the origin rank's; the finite values are averages over the ranks), which replays, bisects and
inspects like a single-process bundle, on one CPU process with no process group.

Nothing here trusts the bundles more than :func:`nanreplay.format.bundle.open_bundle` does: the
layouts are validated there, and every shard is checked against its layout before it is copied.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..errors import BundleFormatError
from ..format.bundle import open_bundle, write_bundle
from ..format.records import BundleContent

logger = logging.getLogger(__name__)

__all__ = ["RunFiles", "RunBundle", "find_run", "sharded_meta", "merge_run", "run_bundle", "describe_run", "describe_state"]

_EXTS = (".h5", ".hdf5", ".safetensors")


@dataclass
class RunFiles:
    """The bundles of one distributed run's failing step, one per rank (``paths[r]`` is rank r's).

    Attributes:
        sharded: the ranks hold shards (FSDP2, tensor parallel) to put together; else (DDP) each
            rank's bundle is whole, and the origin rank's replays alone.
    """

    run_id: str
    failing_step: int
    world_size: int
    paths: list[Path]
    origin_ranks: list[int]
    sharded: bool = True


def sharded_meta(path: Path) -> Optional[dict]:
    """The ``distributed`` entry of ``path`` when it is a distributed run's bundle (it has a
    ``run_id``: every rank's bundle since sharded runs, and DDP runs written by this version), else
    ``None``; with ``failing_step``, ``world_size`` and ``sharded`` (it holds layouts) added."""
    with open_bundle(path) as b:
        d = b.meta.get("distributed") or {}
        if not d.get("run_id"):
            return None
        return {**d, "failing_step": b.failing_step, "world_size": b.meta.get("world_size"), "sharded": bool(d.get("sharding"))}


def find_run(paths: Sequence[Path], *, one_file_whole: bool = False) -> Optional[RunFiles]:
    """The run ``paths`` name: a directory (the run of its newest bundle that has a run id), one
    rank's bundle (its siblings beside it), or every rank's bundle. ``None`` when they are not a
    distributed run's bundles (single-process bundles, or older DDP bundles without a run id: the
    caller treats them as before), and, with ``one_file_whole``, when one file of a DDP run is
    named (it replays alone, as the user chose it).

    Raises:
        BundleFormatError: a sibling is missing, unreadable, or from another run or step; the
            message names the file and what was expected.
    """
    paths = [Path(p) for p in paths]
    one_file = len(paths) == 1 and not paths[0].is_dir()
    if len(paths) == 1 and paths[0].is_dir():
        newest = _newest_run(paths[0])
        if newest is None:
            return None
        paths = [newest]
    elif any(p.is_dir() for p in paths):
        return None
    try:
        first = sharded_meta(paths[0])
    except (BundleFormatError, OSError):  # the caller opens it again and reports the error as for any bundle
        return None
    if first is None or (one_file_whole and one_file and not first["sharded"]):
        return None
    ws = int(first["world_size"])
    if len(paths) == 1:
        names = first.get("siblings") or []
        if len(names) != ws:
            raise BundleFormatError(f"{paths[0]}: lists {len(names)} sibling bundles for world_size {ws}; pass every rank's bundle explicitly")
        paths = [paths[0].parent / n for n in names]
    by_rank = _by_rank(paths, first, ws)
    return RunFiles(first["run_id"], int(first["failing_step"]), ws, [by_rank[r] for r in range(ws)], list(first.get("origin_ranks") or []),
                    sharded=first["sharded"])


def _newest_run(directory: Path) -> Optional[Path]:
    """The newest distributed run's bundle in ``directory`` (among its 64 newest bundles: a
    directory of many bundles is not read whole), or ``None``."""
    found = sorted((p for p in directory.iterdir() if p.suffix in _EXTS and p.is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in found[:64]:
        try:
            if sharded_meta(p) is not None:
                return p
        except BundleFormatError:
            continue
    return None


def _by_rank(paths: list[Path], first: dict, ws: int) -> dict[int, Path]:
    """Each rank's bundle among ``paths``, checked to be of the run, step and world size of
    ``first`` (rank 0's or the named bundle's ``distributed`` entry), one per rank, none missing.

    Raises:
        BundleFormatError: a bundle is missing, of another run or step, given twice, or a rank has none.
    """
    by_rank: dict[int, Path] = {}
    for p in paths:
        if not p.exists():
            raise BundleFormatError(
                f"{p}: missing: the sharded run {first['run_id']} (step {first['failing_step']}, {ws} ranks) needs every rank's bundle "
                f"and this one is not there; copy it beside the others (each rank writes its own into its out_dir)")
        m = sharded_meta(p)
        if m is None or m.get("run_id") != first["run_id"] or m["failing_step"] != first["failing_step"] or m.get("world_size") != ws:
            found = "not a sharded bundle" if m is None else f"run {m.get('run_id')}, step {m['failing_step']}, world_size {m.get('world_size')}"
            raise BundleFormatError(
                f"{p}: inconsistent sibling: expected run {first['run_id']}, step {first['failing_step']}, world_size {ws}; found {found}. "
                "Pass the bundles of one run and one step")
        r = int(m["rank"])
        if r in by_rank:
            raise BundleFormatError(f"{p}: rank {r} given twice ({by_rank[r]} and {p}); pass one bundle per rank")
        by_rank[r] = p
    missing = [r for r in range(ws) if r not in by_rank]
    if missing:
        raise BundleFormatError(f"the sharded run {first['run_id']} has {ws} ranks; no bundle given for rank(s) {missing}: pass every rank's bundle, "
                                "or the directory that holds them")
    return by_rank


def _assemble(name: str, shards: list[tuple[torch.Tensor, dict]], where: str) -> torch.Tensor:
    """The full tensor ``name`` from each rank's (shard, layout); replicated copies overwrite each
    other with the same values."""
    lay0 = shards[0][1]
    full = torch.empty(lay0["global_shape"], dtype=shards[0][0].dtype)
    covered = torch.zeros(lay0["global_shape"], dtype=torch.bool)
    for t, lay in shards:
        if list(t.shape) != lay["local_shape"] or lay["global_shape"] != lay0["global_shape"]:
            raise BundleFormatError(f"{where}: {name}: shard of shape {list(t.shape)} (global {lay['global_shape']}); its layout says "
                                    f"{lay['local_shape']} (global {lay0['global_shape']}): the bundles do not fit together")
        if "P" in lay["placements"]:
            raise BundleFormatError(f"{where}: {name} has a partial placement {lay['placements']}; a pending sum cannot be put together")
        idx = tuple(slice(o, o + n) for o, n in zip(lay["offsets"], lay["local_shape"]))
        full[idx] = t
        covered[idx] = True
    if not bool(covered.all()):
        raise BundleFormatError(f"{where}: {name}: the shards cover {int(covered.sum())} of {covered.numel()} elements; a rank's shard is missing")
    return full


def _assemble_snapshot(snaps: list, layouts: list[dict], opt_map: dict, main: int, where: str) -> Any:
    """One snapshot of full tensors from the ranks' snapshots (the ``main`` rank's for the rest)."""
    base = snaps[main]
    params = dict(base.params)
    for name in layouts[main]:
        params[name] = _assemble(name, [(s.params[name], lay[name]) for s, lay in zip(snaps, layouts)], where)
    opt = base.optimizer
    if opt is not None:
        state = {k: dict(v) for k, v in opt["state"].items()}
        for key, fqn in opt_map.items():
            idx, _, sk = key.partition("/")
            i = int(idx) if idx.isdigit() and int(idx) in state else idx
            if i not in state or sk not in state[i]:
                continue
            state[i][sk] = _assemble(f"optimizer state {key}", [(s.optimizer["state"][i][sk], lay[fqn]) for s, lay in zip(snaps, layouts)], where)
        opt = {**opt, "state": state}
    return replace(base, params=params, optimizer=opt)


def merge_run(run: RunFiles) -> BundleContent:
    """One single-process bundle's content from the run's bundles: full weights and optimizer
    state, the origin rank's (else rank 0's) steps, the gradients put together, and
    ``meta.distributed.merged_from`` naming the bundles. Reads every rank's tensors.

    Raises:
        BundleFormatError: the shards do not fit their layouts or do not cover a tensor.
    """
    main = run.origin_ranks[0] if run.origin_ranks else 0
    rows = []
    trusted = True
    for p in run.paths:
        with open_bundle(p) as b:
            rows.append((b.content(), (b.meta.get("distributed") or {}).get("sharding") or {}))
            trusted = trusted and b.trusted
    content, _ = rows[main]
    layouts = [sh.get("params") or {} for _, sh in rows]
    opt_map = rows[main][1].get("optimizer") or {}
    where = f"run {run.run_id}"
    state = _assemble_snapshot([c.state for c, _ in rows], layouts, opt_map, main, where)
    grads = dict(content.grads)
    for name in grads:
        if name in layouts[main]:
            grads[name] = _assemble(name, [(c.grads[name], lay[name]) for (c, _), lay in zip(rows, layouts)], where)
    steps = [{r.step: r for r in c.steps} for c, _ in rows]
    for r in content.steps:  # weight snapshots (bisect --over layers/steps): put together when every rank kept that step's
        snaps = [by_step.get(r.step).snapshot if by_step.get(r.step) is not None else None for by_step in steps]
        r.snapshot = _assemble_snapshot(snaps, layouts, opt_map, main, f"{where}, snapshot of step {r.step}") if all(snaps) else None
    dist_meta = dict(content.extra_meta.get("distributed") or {})
    dist_meta.pop("sharding", None)
    dist_meta.pop("siblings", None)
    dist_meta.update(grads="reduced", merged_from=[p.name for p in run.paths], replayed_rank=main)
    reason = dict(content.reason)
    reason["distributed"] = {**(reason.get("distributed") or {}), "merged_from": [p.name for p in run.paths],
                             "origin_coordinates": dist_meta.get("origin_coordinates") or {}}
    model_info = dict(content.model_info)
    extra_meta = {**content.extra_meta, "distributed": dist_meta}
    extra_meta["rank"] = main
    return replace(content, state=state, grads=grads, model_info=model_info, reason=reason,
                   extra_meta=extra_meta, trusted=trusted)


@dataclass
class RunBundle:
    """The one bundle that replays a distributed run (see :func:`run_bundle`).

    Attributes:
        path: the bundle to replay; ``None`` when the run records no origin rank and its bundles
            are whole (DDP): then there is no rank to prefer. temporary: ``path`` is a merged
            bundle written for this call (its directory is the caller's to remove).
        run: the run's bundles. note: one line that says which bundle and why.
    """

    path: Optional[Path]
    temporary: bool
    run: RunFiles
    note: str


def run_bundle(paths: Sequence[Path], out_dir: Optional[Path] = None) -> Optional[RunBundle]:
    """The bundle that replays the distributed run ``paths`` name (a directory, one rank's bundle
    or every rank's; see :func:`find_run`), else ``None`` when they are not a distributed run's
    bundles, or name one bundle of a DDP run (it replays as given).

    A sharded run (FSDP2, tensor parallel): its ranks' bundles merged into one (:func:`merge_run`),
    written into ``out_dir`` (default a new temporary directory). A DDP run, whose bundles are each
    whole: the first origin rank's bundle itself, so that ``nanreplay replay DIR`` replays the rank
    where the NaN was born (its embedded program included), not the newest file, which may be a
    clean rank's.

    Raises:
        BundleFormatError: see :func:`find_run` and :func:`merge_run`.
    """
    run = find_run(paths, one_file_whole=True)
    if run is None:
        return None
    where = f"run {run.run_id}, step {run.failing_step}, {run.world_size} ranks"
    if not run.sharded:
        if not run.origin_ranks:
            return RunBundle(None, False, run, f"{where}: no rank's own values were non-finite (the origin rank is not recorded)")
        k = run.origin_ranks[0]
        return RunBundle(run.paths[k], False, run, f"{where}: replaying rank {k}'s bundle, the origin rank's: {run.paths[k]}")
    content = merge_run(run)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="nanreplay-run-"))
    path = out / f"nanreplay-step{run.failing_step}-run{run.run_id}-merged{run.paths[0].suffix}"
    logger.info("merged the %d ranks' bundles of run %s into %s", run.world_size, run.run_id, path)
    main = content.extra_meta.get("rank")
    return RunBundle(write_bundle(path, content, trusted=content.trusted), True, run,
                     f"{where}: the ranks' shards put together; replaying rank {main}'s step"
                     + (" (the origin rank)" if main in run.origin_ranks else " (no origin rank recorded)"))


def describe_state(state: dict) -> str:
    """``"shard of proj.weight (S(0)) held NaN at local [0, 3] = global [4, 3]"``: one rank's first
    non-finite state element (``meta.distributed.state_origin``, from :func:`nanreplay.capture.sharded.first_nonfinite_state`) in words."""
    what = state.get("fqn", "?") if state.get("kind") == "weight" else f"optimizer state {state.get('key')!s} of {state.get('fqn', '?')}"
    pl = state.get("placements")
    value = state.get("value", "a non-finite value")
    if pl:
        return f"shard of {what} ({', '.join(pl)}) held {value} at local {state.get('local_index')} = global {state.get('global_index')}"
    return f"copy of {what} held {value} at {state.get('local_index')}"


def describe_run(run: RunFiles) -> dict[str, Any]:
    """What ``inspect`` shows of a run: ranks, origin ranks, mesh, placements per parameter."""
    with open_bundle(run.paths[0]) as b:
        d = b.meta.get("distributed") or {}
    sh = (d.get("sharding") or {}).get("params") or {}
    return {"run_id": run.run_id, "failing_step": run.failing_step, "world_size": run.world_size, "origin_ranks": run.origin_ranks,
            "origin_coordinates": d.get("origin_coordinates") or {}, "mesh": d.get("mesh"),
            "placements": {n: {"placements": lay["placements"], "global_shape": lay["global_shape"]} for n, lay in sh.items()},
            "bundles": [str(p) for p in run.paths]}

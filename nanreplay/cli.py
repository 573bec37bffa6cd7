"""The ``nanreplay`` command line.

Exit codes (stable, for scripts; :data:`EXIT_CODES` names them, :data:`ERROR_EXITS` maps the
library's exceptions to them, and ``tests/cli/test_cli.py`` checks this table against both):

====  =========================================================================
0     success; for ``replay`` and ``report``: the failure was reproduced
1     an unexpected error (a bug: please report it)
2     usage error (bad option, missing argument) -- click's own code; for ``report`` and
      ``bisect --html`` also: the ``report`` extra (matplotlib) is not installed; a directory
      where a bundle file is expected, or several bundles given to ``replay``, ``report`` or
      ``bisect`` (a shell glob that matched more than one): the message lists the bundles,
      newest first with their failing step; for ``log``: a malformed ``--to``, its tracker's
      library not installed (the ``trackers`` extra), or a tracker that refused the log
3     ``replay``, ``report``: the failure was NOT reproduced (``report`` still writes the page);
      with ``replay --compile``: neither the eager nor the main compiled replay reproduced it
4     the bundle is missing, unreadable, truncated, corrupted or foreign
5     the model, loss function or factory does not fit the bundle, or replay cannot run
      (for ``bisect``: the bundle lacks what the search needs, e.g. a weight snapshot); for ``export --repro``: the
      origin is not an op (the batch, the weights, the optimizer update, no birth), or the op is
      not on the reviewed allowlist (``engine/opset.py``); the sandboxed replay of an untrusted
      bundle's program died (a signal, out of memory), ran past ``--timeout`` or
      ``--memory-limit``, or sent back something that is not a result (one sentence; nothing
      outside the sandbox was touched)
6     ``bisect``: the search named no culprit (the failure did not reproduce, the cause is
      outside what the search varies, or ``--max-replays`` ran out)
7     refused: the bundle is not trusted and names code the command would run (its model
      factory, model class, loss function, optimizer class or batch types); nothing was run.
      Review ``nanreplay inspect BUNDLE``, then ``nanreplay trust BUNDLE`` or ``--trust``, or
      name your own code with ``--model-factory``, ``--loss-fn`` and ``--batch-type``; also:
      the bundle's embedded program may run only in the sandbox, and this machine cannot run
      it (no seccomp): ``--trust`` runs it in-process
====  =========================================================================

A bundle is data: ``inspect`` and ``trust`` never run code from it, and ``replay`` / ``bisect``
run the code it names only under the trust rule above (``docs/security.md``). A bad file never
produces a traceback: it exits 4 with one message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import click

from .errors import BundleFormatError, MissingExtraError, ModelMismatchError, ReplayError, UntrustedBundleError
from .core.inert import inert, inert_name, inert_tree
from .core.results import SCHEMA_VERSION, BisectResult, DiagnosisDict

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_REPRODUCED, EXIT_BAD_BUNDLE, EXIT_REPLAY, EXIT_NOT_FOUND, EXIT_UNTRUSTED = 0, 1, 2, 3, 4, 5, 6, 7

#: every exit code and what it says, in short (the module docstring's table says it in full)
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_ERROR: "an unexpected error",
    EXIT_USAGE: "usage error",
    EXIT_NOT_REPRODUCED: "the failure was not reproduced",
    EXIT_BAD_BUNDLE: "the bundle is missing or unreadable",
    EXIT_REPLAY: "the model, loss function or factory does not fit, or replay cannot run",
    EXIT_NOT_FOUND: "bisect named no culprit",
    EXIT_UNTRUSTED: "refused: the bundle is not trusted",
}

logger = logging.getLogger(__name__)


class CLIError(click.ClickException):
    """A ClickException that exits with ``code``, one of :data:`EXIT_CODES`; click prints
    ``Error: <message>``. The message is made inert (``core.inert``): a bundle string it quotes
    cannot act on the terminal."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(inert(message))
        self.exit_code = code


def _described(e: Any) -> str:
    return e.describe(cli=True)


#: exception type -> exit code and message; :func:`_guard` takes the first row the exception is an
#: instance of (anything else is a bug: exit 1)
ERROR_EXITS: tuple[tuple[type[BaseException], int, Callable[[Any], str]], ...] = (
    (FileNotFoundError, EXIT_BAD_BUNDLE, str),
    (IsADirectoryError, EXIT_BAD_BUNDLE, lambda e: f"{e}: expected a bundle file (.h5 or .safetensors), found a directory."),
    (BundleFormatError, EXIT_BAD_BUNDLE, _described),
    (UntrustedBundleError, EXIT_UNTRUSTED, _described),
    (ModelMismatchError, EXIT_REPLAY, _described),
    (ReplayError, EXIT_REPLAY, _described),
    (MissingExtraError, EXIT_USAGE, str),  # the report extra (matplotlib) is not installed
    (PermissionError, EXIT_BAD_BUNDLE, lambda e: f"{e}; check the file's permissions"),
    # user code (a model factory, a loss function) tried to end the process
    (SystemExit, EXIT_REPLAY, lambda e: f"the code being replayed called sys.exit({e.code!r}); replay cannot finish"),
)


def _exit_for(e: BaseException) -> Optional[CLIError]:
    """The :class:`CLIError` of ``e`` by :data:`ERROR_EXITS`, or ``None`` when no row matches."""
    return next((CLIError(message(e), code) for kind, code, message in ERROR_EXITS if isinstance(e, kind)), None)


def _g(v: Any) -> str:
    """A number of a table, ``%.4g``-style with its exponent (``7.219e+16``), never cut;
    ``-`` for none; a non-finite one as written (``nan``, ``inf``)."""
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.4g}"
    return str(v)


def _guard(fn: Callable[[], Any]) -> Any:
    """Map library errors to clean messages and fixed exit codes (:data:`ERROR_EXITS`), never a
    traceback; anything else is a bug (exit 1)."""
    try:
        return fn()
    except click.ClickException:
        raise
    except (Exception, SystemExit) as e:
        mapped = _exit_for(e)
        if mapped is not None:
            raise mapped from e
        # a bug in nanreplay or in the replayed code: one line, the traceback with -v
        logger.info("unexpected error", exc_info=True)
        raise CLIError(f"unexpected error: {type(e).__name__}: {e} (a bug: please report it; run with -v for the traceback)", EXIT_ERROR) from e


def _import_types(paths: tuple[str, ...]) -> list[type]:
    """The batch types named with --batch-type (user-named code: imported)."""
    from .core.callables import import_callable
    from .core.tree import accepted_types

    out = []
    for p in paths:
        try:
            cls = import_callable(p)
            accepted_types([cls])
        except (ReplayError, TypeError) as e:
            raise click.BadParameter(f"{p}: {e}", param_hint="--batch-type") from e
        out.append(cls)
    return out


_trust_opt = click.option("--trust", is_flag=True, help="Trust this bundle for this run: import and run the code it names (factory, loss function, classes). Review `nanreplay inspect BUNDLE` first.")
_batch_type_opt = click.option("--batch-type", "batch_types", multiple=True, metavar="MODULE:CLASS", help="A dataclass or namedtuple class to rebuild the recorded batch nodes of that type as (repeatable); without it, an untrusted bundle's typed batches are refused.")


#: the names a bundle file may have; a directory's listing also takes files whose first bytes are a bundle's
BUNDLE_SUFFIXES = (".h5", ".hdf5", ".safetensors")
_LISTED = 20        # bundles a listing shows
_SCANNED = 2000     # directory entries a listing looks at


def _bundles_in(directory: Path) -> tuple[list[Path], bool]:
    """The bundle files directly inside ``directory``: a bundle suffix, or a container's magic
    bytes (a renamed bundle); the first ``_SCANNED`` entries only (second item: more were
    skipped). Reads at most 16 bytes of a file; runs nothing."""
    from .format.container import sniff_format

    found, more = [], False
    try:
        entries = iter(os.scandir(directory))
        for i, entry in enumerate(entries):
            if i >= _SCANNED:
                more = True
                break
            if not entry.is_file():
                continue
            p = Path(entry.path)
            if p.suffix.lower() in BUNDLE_SUFFIXES:
                found.append(p)
                continue
            try:
                with open(p, "rb") as fh:
                    head = fh.read(16)
                if sniff_format(head, entry.stat().st_size):
                    found.append(p)
            except OSError:
                continue
    except OSError as e:
        raise CLIError(f"{directory}: cannot list the directory ({e.strerror or e}); pass a bundle file", EXIT_USAGE) from e
    return found, more


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _newest_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: (_mtime(p), str(p)), reverse=True)


def _listing(ordered: list[Path]) -> list[str]:
    """One line per bundle of ``ordered``: path, failing step, time written (or why it is unreadable)."""
    from .format.bundle import open_bundle

    rows = []
    for p in ordered[:_LISTED]:
        try:
            with open_bundle(p) as b:
                what = f"failing step {b.failing_step}"
        except Exception as e:  # noqa: BLE001 - a listing shows a bad file instead of stopping at it
            what = f"not readable ({type(e).__name__})"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_mtime(p)))
        rows.append(f"  {shlex.quote(str(p))}  {what}  written {when}")
    if len(ordered) > _LISTED:
        rows.append(f"  ... and {len(ordered) - _LISTED} more")
    return rows


def _pick_one_error(command: str, head: str, paths: list[Path], more: bool = False) -> CLIError:
    """The usage error (exit 2) of a directory or several bundles where one is needed: the
    bundles, newest first with their failing step, and the command to run on the newest."""
    if not paths:
        return CLIError(f"{head}; it holds no bundle (.h5, .hdf5 or .safetensors file). Pass a bundle file: the Recorder "
                        "writes them into its out_dir (default nanreplay_bundles/)", EXIT_USAGE)
    ordered = _newest_first(paths)
    rows = _listing(ordered)
    newest = shlex.quote(str(ordered[0]))
    return CLIError("\n".join([f"{head}. {command} takes one bundle; the bundles, newest first:", *rows]
                              + (["  (only the first entries of the directory were looked at)"] if more else [])
                              + [f"Pick one, e.g. the newest: nanreplay {command} {newest}"]), EXIT_USAGE)


def _distributed_run(command: str, value: tuple[Path, ...]) -> Optional[Path]:
    """The bundle that replays a distributed run (:func:`nanreplay.engine.shards.run_bundle`): for
    a sharded run (FSDP2, tensor parallel) given as a directory, one rank's bundle or every rank's,
    one merged bundle of full tensors; for a DDP run given as a directory or several rank bundles,
    the origin rank's bundle. Says which on stderr (on a terminal; logged at info level). ``None``
    when ``value`` is no distributed run (or one DDP bundle, which replays as given). A missing or inconsistent sibling is exit 4,
    naming it; a DDP run with no origin rank recorded is a usage error listing its bundles."""
    import atexit

    from .engine.shards import run_bundle

    found = _guard(lambda: run_bundle(value))
    if found is None:
        return None
    if found.path is None:
        raise _pick_one_error(command, inert(found.note, one_line=True), found.run.paths)
    if found.temporary:
        from .engine.sandbox import computed

        computed()  # the merge copied tensors (OpenMP's pool may exist): a sandboxed child runs one thread
        atexit.register(_drop_merged, found.path)  # a temporary file: gone, with its trust entry, when the command ends
    logger.info("%s", found.note)
    if sys.stderr.isatty():  # on a terminal: say which bundle replays (stdout stays the report or the JSON)
        click.echo(f"nanreplay: {inert(found.note, one_line=True)}", err=True)
    return found.path


def _drop_merged(path: Path) -> None:
    import shutil

    from .errors import NanReplayError
    from .format.bundle import untrust_bundle

    try:
        untrust_bundle(path)
    except (OSError, NanReplayError) as e:
        logger.debug("could not drop the trust entry of %s: %s", path, e)
    shutil.rmtree(path.parent, ignore_errors=True)


def _one_bundle(ctx: click.Context, param: click.Parameter, value: tuple[Path, ...]) -> Path:
    """The BUNDLE argument of replay, report and bisect: exactly one bundle file. A directory, or
    several files (a shell glob that matched more than one), is a usage error (exit 2) that lists
    the bundles, newest first with their failing step."""
    command = ctx.info_name or "replay"
    chosen = _distributed_run(command, value)
    if chosen is not None:
        return chosen
    if len(value) == 1 and not value[0].is_dir():
        return value[0]
    if len(value) == 1:
        found, more = _bundles_in(value[0])
        raise _pick_one_error(command, f"{value[0]} is a directory", found, more)
    dirs = [v for v in value if v.is_dir()]
    if dirs:
        raise _pick_one_error(command, f"{dirs[0]} is a directory", _bundles_in(dirs[0])[0])
    raise _pick_one_error(command, f"{len(value)} bundles were given (a shell glob such as nanreplay-step*.h5 matched several)",
                          [v for v in value if v.exists()] or list(value))


def _bundle_files(ctx: click.Context, param: click.Parameter, value: tuple[Path, ...]) -> tuple[Path, ...]:
    """The BUNDLES of inspect and trust: files; a directory among them is a usage error (exit 2)
    that lists the bundles inside it."""
    for v in value:
        if v.is_dir():
            found, more = _bundles_in(v)
            command = ctx.info_name or "inspect"
            if not found:
                raise _pick_one_error(command, f"{v} is a directory", found, more)
            ordered = _newest_first(found)
            raise CLIError("\n".join([f"{v} is a directory; {command} takes bundle files. The bundles in it, newest first:", *_listing(ordered)]
                                      + [f"Name them, e.g.: nanreplay {command} {shlex.quote(str(ordered[0]))}"]), EXIT_USAGE)
    return value


def _replay_options(fn: Callable) -> Callable:
    """The options of one replay, shared by ``replay`` and ``report`` (which replays first)."""
    for opt in reversed([
        click.option("--model-factory", metavar="MODULE:FUNCTION", help="Zero-argument function returning the model (default: the program "
                     "embedded in the bundle, else the recorded factory). 'pkg.mod:fn' or 'path/file.py:fn'."),
        click.option("--loss-fn", metavar="MODULE:FUNCTION", help="loss_fn(model, batch) -> loss (default: the recorded one)."),
        click.option("--no-loss-fn", is_flag=True, help="Ignore any loss function; drive backward with the recorded cotangent."),
        click.option("--device", help="Device to replay on, e.g. cpu or cuda:0 (default: the recorded one when present)."),
        click.option("--no-ops", is_flag=True, help="Skip the op-level monitor (faster; names modules only)."),
        click.option("--allow", "allow", multiple=True, metavar="MODULE:OP[:-inf]", help="Allowlist rule for legitimate non-finite values "
                     "(fnmatch patterns; repeatable), on top of the defaults for -Inf attention masks and the rules recorded in the bundle."),
        click.option("--no-default-allow", is_flag=True, help="Drop the default allowlist (-Inf written by masked_fill/where/full...)."),
        click.option("--no-samples", is_flag=True, help="Skip the per-sample replays that find which samples to blame."),
    ]):
        fn = opt(fn)
    return fn


def _sandbox_options(fn: Callable) -> Callable:
    """``--timeout`` and ``--memory-limit``: the limits of the sandbox an untrusted bundle's
    embedded program replays in (``docs/security.md``, "The sandbox")."""
    fn = click.option("--memory-limit", type=click.FloatRange(min=0.25), metavar="GIB",
                      help="Address space the sandboxed replay may add, in GiB (default: 1.5 GiB + 8 x the bundle's size).")(fn)
    return click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True, metavar="SECONDS",
                        help="Wall-clock limit of the sandboxed replay: an untrusted bundle's program runs in a child process "
                             "(seccomp, no file writes, no network) that is killed past it (exit 5).")(fn)


def _limits(timeout: float, memory_limit: Optional[float]) -> Any:
    """The :class:`~nanreplay.engine.sandbox.SandboxLimits` of ``--timeout`` / ``--memory-limit``."""
    from .engine.sandbox import SandboxLimits

    return SandboxLimits(timeout=timeout, memory=None if memory_limit is None else int(memory_limit * 2**30))


_bundle_arg = click.argument("bundle", nargs=-1, required=True, metavar="BUNDLE", callback=_one_bundle,
                             type=click.Path(dir_okay=True, path_type=Path))


def _dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str, allow_nan=False)


def _versioned(result: Any) -> dict:
    """``result`` (a :class:`~nanreplay.core.results.DiagnosisDict` or
    :class:`~nanreplay.core.results.BisectResult`) as ``--json`` prints it: ``schema_version`` first,
    the version of the shipped JSON Schema (``nanreplay/schema/``) the output follows."""
    return {"schema_version": SCHEMA_VERSION, **result}


_color_option = click.option(
    "--color/--no-color", "color", default=None,
    help="Colour the report (default: colour when stdout is a terminal, plain text when piped).",
)


class _Status:
    """A one-line status on stderr for work that takes more than ``delay`` seconds, for
    ``replay(..., progress=status)``: each call sets the message; a thread redraws it with the
    elapsed time. Draws nothing when stderr is not a terminal or the work ends within ``delay``;
    the line is erased at the end, so stdout (the report) is never mixed with it."""

    _FRAMES = "|/-\\"

    def __init__(self, *, enabled: bool, delay: float = 1.0, interval: float = 0.1) -> None:
        self.enabled, self.delay, self.interval = enabled, delay, interval
        self.message = "starting"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._shown = False
        self._t0 = 0.0

    def __call__(self, message: str) -> None:
        self.message = message

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        i = 0
        while not self._stop.is_set():
            self._shown = True
            sys.stderr.write(f"\r{self._FRAMES[i % 4]} {inert_name(self.message)} ({time.monotonic() - self._t0:.0f} s)\x1b[K")
            sys.stderr.flush()
            i += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "_Status":
        self._t0 = time.monotonic()
        if self.enabled:
            from .core.rng import STATUS_THREAD_NAME  # a replay beside this thread keeps the process-wide generators

            self._thread = threading.Thread(target=self._run, name=STATUS_THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _replay_with_status(bundle: Path, **kwargs: Any) -> DiagnosisDict:
    """``nanreplay.replay(bundle, **kwargs)`` with a status line on a terminal's stderr and the
    library's errors mapped to exit codes. Validates ``allow`` rules first (exit 2)."""
    from .core.allowlist import AllowRule
    from .diagnosis.api import replay as run

    for rule in kwargs.get("allow") or []:
        try:
            AllowRule.parse(rule)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--allow") from e
    with _Status(enabled=sys.stderr.isatty()) as status:
        return _guard(lambda: run(bundle, progress=status, **kwargs))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nanreplay")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Capture-and-replay forensics for NaN and Inf in PyTorch training.

    A Recorder in the training loop writes a bundle on the first non-finite gradient;
    these commands inspect and replay it.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(_InertFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), handlers=[handler])


class _InertFormatter(logging.Formatter):
    """Log lines quote bundle strings (names, paths): made inert before they reach the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        return inert(super().format(record))


@main.command()
@_bundle_arg
@_replay_options
@click.option("--rows", default=8, show_default=True, help="Rows of the health table.")
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as JSON (fields in docs/report.md).")
@click.option("--import-script", is_flag=True, help="Allow importing the factory or loss function from a script that runs code at import (a training script without an `if __name__ == \"__main__\":` guard trains again).")
@click.option("--compile", "compile_", is_flag=True, help="Also replay the step under torch.compile as the recording compiled it (its backend, mode, options and compiled modules; inductor when the bundle does not say), beside eager and aot_eager (same weights, batch and RNG states): says whether the NaN appears only under compile, which compiler stage brings it, and the op, source line and samples inside the compiled region.")
@click.option("--compile-backend", multiple=True, metavar="BACKEND", help="Add BACKEND (inductor, aot_eager, aot_eager_decomp_partition, eager, ...) to the --compile comparison as one more column; the recording's backend stays the main one. Repeatable; implies --compile.")
@_trust_opt
@_batch_type_opt
@_sandbox_options
@_color_option
def replay(bundle: Path, model_factory: Optional[str], loss_fn: Optional[str], no_loss_fn: bool, device: Optional[str], no_ops: bool,
           allow: tuple, no_default_allow: bool, no_samples: bool, rows: int, as_json: bool, import_script: bool, compile_: bool, compile_backend: tuple,
           trust: bool, batch_types: tuple, timeout: float, memory_limit: Optional[float], color: Optional[bool]) -> None:
    """Re-execute the failing step of BUNDLE and name where the non-finite value was born.

    The program embedded in BUNDLE is data and replays without trust; the code BUNDLE names
    (model factory, loss function, classes) runs only when the bundle is trusted: written by
    your Recorder on this machine, `nanreplay trust BUNDLE`, or --trust. An untrusted bundle's
    program replays in a sandbox: a child process that may not write files, run programs or open
    sockets, within --timeout and --memory-limit.
    Exit code 0 when the failure reproduced, 3 when it did not, 5 when the sandboxed replay died
    or ran past a limit, 7 when refused as untrusted.
    """
    from .report.summary import reproduced
    from .report.text import render_report

    diag = _replay_with_status(bundle, model_factory=model_factory, loss_fn=loss_fn, device=device, ops=not no_ops, use_loss_fn=not no_loss_fn,
                               allow=list(allow), default_allow=not no_default_allow, samples=not no_samples, import_script=import_script,
                               trust=trust, batch_types=_import_types(batch_types), compile=list(compile_backend) or compile_,
                               sandbox=_limits(timeout, memory_limit))
    if as_json:
        click.echo(_dump_json(_versioned(diag)), color=False)
    else:
        click.echo(render_report(diag, rows=rows, color=color is not False), color=color)
    if not reproduced(diag):
        sys.exit(EXIT_NOT_REPRODUCED)


@main.command()
@_bundle_arg
@click.option("--model-factory", metavar="MODULE:FUNCTION", help="Zero-argument function returning the fixed model (default: the program "
              "embedded in the bundle, else the recorded factory).")
@click.option("--loss-fn", metavar="MODULE:FUNCTION", help="loss_fn(model, batch) -> loss (default: the recorded one).")
@click.option("--device", help="Device to replay on (default: the recorded one when present).")
@click.option("--import-script", is_flag=True, help="Allow importing the factory or loss function from a script that runs code at import.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_trust_opt
@_sandbox_options
def check(bundle: Path, model_factory: Optional[str], loss_fn: Optional[str], device: Optional[str], import_script: bool, as_json: bool,
          trust: bool, timeout: float, memory_limit: Optional[float]) -> None:
    """Replay the recorded failing step of BUNDLE on the code as it is now (a regression test).

    Exit code 0 when the step now replays finite, 3 when it is still non-finite.
    """
    from .testing import check_finite

    out = _guard(lambda: check_finite(bundle, model_factory=model_factory, loss_fn=loss_fn, device=device, trust=trust, import_script=import_script,
                                      sandbox=_limits(timeout, memory_limit)))
    if as_json:
        from .core.jsonable import jsonable

        click.echo(_dump_json(jsonable(out)))  # a non-finite loss as "nan" / "-inf": JSON has no NaN
    elif out["finite"]:
        loss = f" (loss {out['loss']:.4g})" if isinstance(out["loss"], float) else ""
        click.echo(f"step {out['step']} replays finite{loss}: the fix holds")
    else:
        click.echo(f"step {out['step']} still replays non-finite ({', '.join(out['nonfinite'])}); "
                   f"nanreplay replay {shlex.quote(str(bundle))} names where the NaN is born now")
    if not out["finite"]:
        sys.exit(EXIT_NOT_REPRODUCED)


@main.command()
@_bundle_arg
@click.option("--repro", "repro", required=True, metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              help="Write the origin op's reproducer here: repro.py (needs only torch; exit 0 when it reproduces the non-finite value, "
                   "1 when not) and op_inputs.safetensors (the op's recorded inputs; for a backward birth also the output gradient).")
@click.option("--model-factory", metavar="MODULE:FUNCTION", help="Zero-argument function returning the model (default: the program "
              "embedded in the bundle, else the recorded factory).")
@click.option("--loss-fn", metavar="MODULE:FUNCTION", help="loss_fn(model, batch) -> loss (default: the recorded one).")
@click.option("--no-loss-fn", is_flag=True, help="Ignore any loss function; drive backward with the recorded cotangent.")
@click.option("--device", help="Device to replay on (default: the recorded one when present); the reproducer runs on the CPU.")
@click.option("--import-script", is_flag=True, help="Allow importing the factory or loss function from a script that runs code at import.")
@_trust_opt
@_batch_type_opt
@_sandbox_options
def export(bundle: Path, repro: Path, model_factory: Optional[str], loss_fn: Optional[str], no_loss_fn: bool, device: Optional[str],
           import_script: bool, trust: bool, batch_types: tuple, timeout: float, memory_limit: Optional[float]) -> None:
    """Write a reproducer of BUNDLE's failing step anyone can run: the origin op alone, with its inputs.

    Replays the step (under the trust rule of `replay`), finds the aten op that gave birth to the
    non-finite value and writes DIR/repro.py and DIR/op_inputs.safetensors, for an upstream bug
    report or a unit test. Exit code 0 when written, 5 when the origin is not an op (the batch, the
    weights, the optimizer update) or the op is not on the reviewed allowlist.
    """
    from .diagnosis.repro import export_repro

    with _Status(enabled=sys.stderr.isatty()) as status:
        out = _guard(lambda: export_repro(bundle, repro, model_factory=model_factory, loss_fn=loss_fn, use_loss_fn=not no_loss_fn,
                                          device=device, trust=trust, batch_types=_import_types(batch_types), import_script=import_script,
                                          progress=status, sandbox=_limits(timeout, memory_limit)))
    what = f"aten {out['op']}" + (" and its derivative (with the recorded output gradient)" if out["backward"] else "") + " on its recorded inputs"
    where = f", {out['where']}" if out.get("where") else ""
    click.echo(inert(f"wrote {out['script']} and {out['tensors']} ({out['bytes']} bytes): {what} (step {out['step']}{where})"))
    click.echo(inert(f"run it: python {shlex.quote(out['script'])}  (exit 0: the non-finite value is reproduced, 1: not)"))


@main.command()
@click.argument("bundles", nargs=-1, required=True, callback=_bundle_files, type=click.Path(dir_okay=True, path_type=Path))
@click.option("--keys/--no-keys", default=True, show_default=True, help="List tensor keys with shape and dtype.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Read every tensor and check its CRC-32, so a corrupted bundle is reported (exit 4).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_color_option
def inspect(bundles: tuple[Path, ...], keys: bool, verify: bool, as_json: bool, color: Optional[bool]) -> None:
    """Summarise BUNDLES without running anything: steps held, tensors, sizes, metadata, the
    stored diagnosis, whether each bundle is trusted and which code it names. Safe on untrusted
    files: no code from the bundle runs; memory stays bounded whatever the file says.

    Given the bundles of several ranks of one distributed run, also says which rank the
    non-finite values were born on (JSON: {"bundles": [...], "ranks": {...}})."""
    from .capture.ddp import rank_summary

    infos = [_guard(lambda b=b: _summarise(b, keys, verify)) for b in bundles]
    if len(infos) == 1:
        info = infos[0]
        if as_json:
            click.echo(_dump_json(info))
            return
        _echo_summary(info, keys, color)
        return
    ranks = rank_summary(infos)
    if as_json:
        click.echo(_dump_json({"bundles": infos, "ranks": ranks}))
        return
    for info in infos:
        _echo_summary(info, keys, color)
        click.echo("")
    click.echo(f"ranks {inert(ranks['ranks'], one_line=True)}: " + click.style(inert(ranks["message"], one_line=True), bold=True), color=color)


def _summarise(bundle: Path, keys: bool, verify: bool = True) -> dict:
    from .format.bundle import open_bundle

    with open_bundle(bundle) as b:
        infos = {k: b.info(k) for k in b.keys()}
        if verify:
            for k in infos:
                b.verify(k)  # raises BundleFormatError on a CRC mismatch; reads in bounded chunks
        steps = []
        for s in b.meta["steps"]:
            steps.append(
                {
                    "step": s["step"],
                    "forwards": len(s["forwards"]),
                    "batches": len(s["batches"]),
                    "loss": s.get("loss"),
                    "grad_norm": s.get("grad_norm"),
                    "lrs": s.get("lrs"),
                    "finite": s.get("finite"),
                    "snapshot": bool(s.get("snapshot")),
                }
            )
        return {
            "path": str(b.path),
            "format": b.format,
            "failing_step": b.failing_step,
            "reason": b.meta.get("reason"),
            "environment": b.meta.get("environment"),
            "model_class": (b.meta.get("model") or {}).get("class"),
            "model_factory": b.model_factory,
            "loss_fn": b.loss_fn,
            "optimizer": (b.meta.get("optimizer") or {}).get("class"),
            "steps": steps,
            "grads": {"whole": len(b.meta["grads"]), "digests": len(b.grads_digested)},
            "tensors": len(infos),
            "tensor_bytes": sum(i.nbytes for i in infos.values()),
            "file_bytes": b.path.stat().st_size,
            "keys": {k: {"shape": list(i.shape), "dtype": str(i.dtype).replace("torch.", ""), "nbytes": i.nbytes} for k, i in infos.items()} if keys else None,
            "diagnosis": b.diagnosis,
            "diagnosis_error": b.meta.get("diagnosis_error") if isinstance(b.meta.get("diagnosis_error"), str) else None,
            "trusted": b.trusted,
            "code": b.named_code(),
            **{k: b.meta[k] for k in ("rank", "world_size", "distributed") if k in b.meta},
        }


def _code_listing(code: dict) -> str:
    """The review line of what a bundle names (``Bundle.named_code()``): ``model factory a:b;
    loss function c:d``, every name escaped by :func:`~nanreplay.core.inert.inert_name` (a ``\\r``
    in a name shows as ``\\r`` and cannot hide the text before it); empty when it names nothing."""
    return "; ".join(f"{inert_name(kind)} " + ", ".join(inert_name(n) for n in names) for kind, names in code.items())


def _echo_distributed(info: dict, echo: Callable[[str], None]) -> None:
    """The lines of ``inspect`` for a rank's bundle of a distributed run (``info``: made inert)."""
    d = info.get("distributed") or {}
    echo(f"  rank {info['rank']} of {info.get('world_size')}   origin rank(s) of the failure: {d.get('origin_ranks')}   gradients stored: {d.get('grads')}")
    if d.get("rank_flags") is not None:
        own = {True: "clean (its own values were finite)", False: "an origin", None: "not checked"}.get(d.get("clean"), "not checked")
        det = d.get("detection") or {}
        echo(f"  this rank: {own}   every rank's flag: {d.get('rank_flags')}   origin detection: "
             f"{'on' if det.get('on') else 'off'} ({det.get('method')}{'; ' + str(det['why_off']) if det.get('why_off') else ''})")
    if d.get("state_origin"):
        so = d["state_origin"]
        echo(f"  step-start state of rank(s) {d.get('state_ranks')} non-finite; here: {so.get('kind')} {so.get('fqn')}"
             f"{' ' + str(so.get('key')) if so.get('key') else ''} {so.get('value')} at local {so.get('local_index')} = global {so.get('global_index')}")
    if d.get("run_id"):
        echo(f"  run {d['run_id']}   siblings: {', '.join(d.get('siblings') or [])}")
    if d.get("sharding") is not None:  # a sharded run (FSDP2, tensor parallel): this rank holds shards
        mesh = d.get("mesh") or {}
        echo(f"  sharded: mesh {mesh.get('shape')} {mesh.get('dim_names') or ''}  this rank at {d.get('coordinate')}"
             f"   origin coordinates: {d.get('origin_coordinates')}")
        for n, lay in list(((d.get("sharding") or {}).get("params") or {}).items())[:_LISTED]:
            echo(f"    {n}: {'/'.join(lay['placements'])}  global {lay['global_shape']}  shard {lay['local_shape']} at {lay['offsets']}")


def _echo_summary(info: dict, keys: bool, color: Optional[bool] = None) -> None:
    from .report.text import styler

    st = styler(color is not False)
    review = _code_listing(info.get("code") or {})
    names = {k: inert_name(info[k]) for k in ("model_class", "model_factory", "loss_fn", "optimizer") if info.get(k) is not None}
    info = inert_tree(info, one_line=True)  # every string from the bundle shows, escaped, and acts on nothing
    info.update(names)  # names of code: every character outside printable ASCII escaped (no look-alike)

    def echo(line: str) -> None:
        click.echo(line, color=color)

    echo(f"{st(info['path'], bold=True)} ({info['format']}, {info['file_bytes']} bytes, {info['tensors']} tensors, {info['tensor_bytes']} tensor bytes)")
    env = info.get("environment") or {}
    echo(f"  written by nanreplay {env.get('nanreplay')}, torch {env.get('torch')}, numpy {env.get('numpy')}, python {env.get('python')}")
    if "rank" in info:
        _echo_distributed(info, echo)
    echo(f"  failing step: {st(str(info['failing_step']), fg='red', bold=True)}   reason: {info['reason']}")
    echo(f"  model: {info['model_class']}   factory: {info['model_factory']}   loss_fn: {info['loss_fn']}   optimizer: {info['optimizer']}")
    echo("  steps held (ring buffer):")
    for s in info["steps"]:
        echo(
            f"    step {s['step']:>6}  forwards {s['forwards']}  batches {s['batches']}  loss {s['loss']}  grad norm {s['grad_norm']}  lr {s['lrs']}"
            + ("  [weights snapshot]" if s["snapshot"] else "")
        )
    g = info.get("grads") or {}
    echo(f"  failing step's gradients: {g.get('whole', 0)} whole, {g.get('digests', 0)} as digests (counts, non-finite positions, norms, "
         "a hash: Recorder(store_grads=...))" if g.get("digests") else f"  failing step's gradients: {g.get('whole', 0)} whole")
    d = info.get("diagnosis")
    none = f"(none: {info['diagnosis_error']})" if info.get("diagnosis_error") else "(none)"
    echo(f"  stored diagnosis: {st((d or {}).get('summary') or none, bold=bool(d))}")
    trusted = "trusted (replay runs it)" if info.get("trusted") else st("NOT trusted (replay refuses it; `nanreplay trust` after review)", fg="yellow")
    echo(f"  code it names: {review or 'none'}   {trusted if review else ''}".rstrip())
    if keys and info["keys"]:
        echo("  tensors:")
        for k, v in info["keys"].items():
            dtype = st(f"{v['dtype']:<10}", fg="cyan")
            echo(f"    {k:<60} {dtype} {str(v['shape']):<20} {v['nbytes']} B")


def _against_config(ctx: click.Context, param: click.Parameter, value: Optional[Path]) -> Optional[Path]:
    """``--against`` goes with ``--over config`` (a usage error, exit 2, otherwise)."""
    over = ctx.params.get("over", "layers")
    if value is not None and over != "config":
        raise click.BadParameter(f"--against goes with --over config, not --over {over}")
    return value


@main.command()
@_bundle_arg
@click.option("--over", type=click.Choice(["layers", "precision", "steps", "samples", "config"]), default="layers", show_default=True,
              is_eager=True, help="What to search over.")  # eager: --against's check reads it wherever it is written
@click.option("--against", type=click.Path(dir_okay=True, path_type=Path), metavar="BUNDLE_B", callback=_against_config,
              help="--over config: another run's bundle (a healthy run's, e.g. a spike bundle); the search sets the settings the two runs "
                   "differ in to B's values instead of to their conservative ones. Only B's metadata is read; nothing it names runs.")
@click.option("--max-replays", default=64, show_default=True, type=click.IntRange(min=1), help="Most replays the search may run.")
@click.option("--threshold", default=10.0, show_default=True, type=click.FloatRange(min=1, min_open=True), help="--over steps (and the walk of --over layers to the first abnormal step): a grad norm or update norm above THRESHOLD x the median of the earlier steps leaves the healthy range.")
@click.option("--model-factory", metavar="MODULE:FUNCTION", help="Zero-argument function returning the model (default: the one recorded in the bundle).")
@click.option("--loss-fn", metavar="MODULE:FUNCTION", help="loss_fn(model, batch) -> loss (default: the recorded one).")
@click.option("--device", help="Device to replay on (default: the recorded one when present).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--html", "html", is_flag=False, flag_value="", default=None, metavar="[FILE]",
              help="Also write the search as a self-contained HTML page: the replays tried and the culprit (default FILE: "
                   "BUNDLE-bisect-OVER.html beside the bundle; write --html=FILE, or --html after BUNDLE). Needs the report extra: "
                   "pip install 'nanreplay[report]'.")
@_trust_opt
@_batch_type_opt
@_sandbox_options
@_color_option
def bisect(bundle: Path, over: str, against: Optional[Path], max_replays: int, threshold: float, model_factory: Optional[str], loss_fn: Optional[str],
           device: Optional[str], as_json: bool, html: Optional[str], trust: bool, batch_types: tuple, timeout: float, memory_limit: Optional[float],
           color: Optional[bool]) -> None:
    """Search BUNDLE for the cause of its non-finite step by replaying variations of it:
    the layers whose weight change makes it non-finite, the first layer that must run in float32,
    the first step that left the healthy range, the smallest bad subset of the batch, or the
    recorded setting (autocast dtype, TF32, matmul precision, attention kernel, compile backend
    and mode, fused optimizer) whose change makes it finite (--over config, --against B).

    Prints one sentence, then details. Exit code 0 when a culprit was named, 6 when not, 7 when
    refused as untrusted (see `nanreplay replay --help`). The bundle is never modified.
    """
    from .report.text import styler
    from .search.api import bisect as run

    if html is not None:
        _require_report_extra()
    types = _import_types(batch_types)
    err = sys.stderr
    show = err.isatty()
    with click.progressbar(length=max_replays, label=f"bisect --over {over}", file=err) if show else contextlib.nullcontext() as bar:
        res: BisectResult = _guard(lambda: run(bundle, over=over, max_replays=max_replays, threshold=threshold, model_factory=model_factory, loss_fn=loss_fn, device=device, progress=bar.update if bar is not None else None,
                                 trust=trust, batch_types=types, against=against, sandbox=_limits(timeout, memory_limit)))
    if as_json:
        click.echo(_dump_json(_versioned(res)))
    else:
        st = styler(color is not False)
        res_text = inert_tree(res, one_line=True)  # the result quotes bundle strings (layer names, warnings)

        def echo(line: str) -> None:
            click.echo(line, color=color)

        echo(st(res_text["answer"], bold=True))
        echo("")
        echo(f"  status:   {st(res_text['status'], fg='green' if res_text['status'] == 'found' else 'red', bold=True)}")
        echo(f"  replays:  {res_text['replays']} (max {res_text['max_replays']}) on {res_text['device']}")
        for c in res_text["culprits"]:
            echo("  culprit:  " + st(", ".join(f"{k} {v}" for k, v in c.items() if not isinstance(v, (dict, list))), fg="red"))
        w = res_text.get("window")
        if w:  # --over layers searched around the first abnormal step (search.window)
            names = lambda ls: ", ".join(L or "(root)" for L in ls) or "none"  # noqa: E731
            healthy = f"step {w['good_step']}" if w["good_step"] is not None else "none held"
            echo(f"  window:   last healthy {healthy}, first abnormal step {w['first_abnormal_step']}, failing step {w['failing_step']}")
            if w["good_step"] is not None:
                echo(f"  spread:   abnormal at step {w['bad_step']}: {names(w['corrupted'])}; spread to by step {w['failing_step']}: {names(w['spread_to'])}")
        d = res_text["details"]
        if d.get("verification"):
            echo(f"  replay:   {d['verification']}")
        raw = res.get("details") or {}
        for row, num in zip(d.get("timeline", []), raw.get("timeline", [])):
            echo(
                f"    step {row['step']:>5}  loss {_g(num.get('loss')):<12} grad norm {_g(num.get('grad_norm')):<12} update {_g(num.get('update_norm')):<12}"
                f" recorded ok {row['matches_recording']!s:<5} {st('; '.join(row['anomalies']), fg='red')}"
            )
        _config_lines(d, echo)  # --over config: the settings tried
        for r, num in zip(d.get("largest_moves", [])[:5], raw.get("largest_moves", [])):
            echo(f"    moved {r['layer'] or '(root)':<28} relative change {_g(num.get('relative_change')):<12} max |change| {_g(num.get('max_abs_diff'))}")
        for w in res_text["warnings"]:
            echo(f"  {st('warning:', fg='yellow')}  {w}")
    if html is not None:
        from .report.html import render_bisect_html

        out = Path(html) if html else bundle.with_name(f"{bundle.stem}-bisect-{over}.html")
        meta = _guard(lambda: _bundle_meta(bundle))
        _write_page(out, render_bisect_html(res, meta=meta))
        click.echo(f"bisect page written to {inert(out)}", err=as_json)
    if res["status"] != "found":
        sys.exit(EXIT_NOT_FOUND)


@main.command()
@click.argument("bundle_a", metavar="A", type=click.Path(dir_okay=True, path_type=Path))
@click.argument("bundle_b", metavar="[B]", required=False, type=click.Path(dir_okay=True, path_type=Path))
@click.option("--here", is_flag=True, help="Compare A with this process's environment (versions, numerics flags, environment variables) instead of a bundle B.")
@click.option("--json", "as_json", is_flag=True, help="Print the difference as JSON (nanreplay/schema/diff.schema.json).")
@click.option("--html", "html", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE", help="Also write the difference as a self-contained HTML page.")
@click.option("--rows", default=40, show_default=True, type=click.IntRange(min=1), help="Rows of each group in the text output.")
@_color_option
def diff(bundle_a: Path, bundle_b: Optional[Path], here: bool, as_json: bool, html: Optional[Path], rows: int, color: Optional[bool]) -> None:
    """What differs between the runs that wrote bundles A and B: library versions, numerics
    flags, autocast, compile settings, the optimizer, distributed reduce dtypes, environment
    variables, the data each step read. The differences that can change a step's numbers come
    first, most likely first; those `bisect A --over config --against B` can toggle in a replay
    are marked.

    With --here instead of B: A against this process (versions, flags, variables). Reads only
    the bundles' metadata: nothing they name runs. Exit 0 when compared, 2 for a usage error,
    4 for an unreadable bundle.
    """
    from .core.settings import diff_settings
    from .report.text import render_diff

    if (bundle_b is None) == (not here):
        raise click.UsageError("give a second bundle B, or --here to compare A with this process's environment (not both)")
    meta_a = _guard(lambda: _bundle_meta(bundle_a))
    if here:
        from .format.environment import environment

        meta_b: dict = {"environment": environment()}
        name_b = "this process"
    else:
        assert bundle_b is not None
        meta_b = _guard(lambda: _bundle_meta(bundle_b))
        name_b = str(bundle_b)
    result = diff_settings(meta_a, meta_b, a_name=str(bundle_a), b_name=name_b, b_here=here)
    if as_json:
        click.echo(_dump_json(_versioned(result)), color=False)
    else:
        click.echo(render_diff(result, color=color is not False, rows=rows), color=color)
    if html is not None:
        from .report.html import render_diff_html

        _write_page(html, render_diff_html(result))
        click.echo(f"diff page written to {inert(html)}", err=as_json)


def _config_lines(d: dict, echo: Callable[[str], None]) -> None:
    """``bisect --over config``'s details in words: the settings tried, those no replay can change."""
    from .core.settings import show_value

    for c in d.get("candidates", []):
        echo(f"    candidate {c['setting']}: {show_value(c['recorded'])} -> {show_value(c['changed_to'])}")
    for c in d.get("cannot_toggle", [])[:10]:
        echo(f"    not replayable {c['setting']}: {show_value(c['a'])} vs {show_value(c['b'])} (nanreplay diff)")


def _require_report_extra() -> None:
    """Exit 2 with the extra to install when matplotlib is missing."""
    from .report.plots import require_matplotlib

    _guard(require_matplotlib)


def _bundle_meta(bundle: Path) -> dict:
    from .format.bundle import open_bundle

    with open_bundle(bundle) as b:
        return dict(b.meta)


def _write_page(out: Path, page: str) -> None:
    """Write an HTML page (UTF-8) under a temporary name, then rename it into place."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        raise CLIError(f"cannot write the report to {out}: {e.strerror or e}; pass a writable path with -o/--output.", EXIT_USAGE) from e


@main.command()
@_bundle_arg
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="The HTML file to write (default: BUNDLE with the suffix .html).")
@click.option("--open", "open_browser", is_flag=True, help="Open the report in the default browser once written.")
@click.option("--no-replay", is_flag=True, help="Use the diagnosis stored in the bundle instead of replaying the step (fast; imports no code named by the bundle).")
@_replay_options
@_trust_opt
@_batch_type_opt
@_sandbox_options
@_color_option
def report(bundle: Path, output: Optional[Path], open_browser: bool, no_replay: bool, model_factory: Optional[str], loss_fn: Optional[str], no_loss_fn: bool,
           device: Optional[str], no_ops: bool, allow: tuple, no_default_allow: bool, no_samples: bool, trust: bool, batch_types: tuple,
           timeout: float, memory_limit: Optional[float], color: Optional[bool]) -> None:
    """Replay the failing step of BUNDLE and write the diagnosis as one self-contained HTML file:
    the loss and grad-norm curves before the failure, the forward pass module by module, the
    causal chain of births, the samples, the environment. The file loads nothing from the
    network; attach it to a bug report.

    Needs the report extra (pip install 'nanreplay[report]', matplotlib), else exits 2.
    Exit code 0 when written, 3 when written but the replay did not reproduce the failure.
    """
    from .report.text import styler

    _require_report_extra()
    from .report.summary import reproduced
    from .report.html import render_html

    if no_replay:
        meta = _guard(lambda: _bundle_meta(bundle))
        diag = meta.get("diagnosis")
        if not diag:
            raise CLIError(
                f"{bundle}: the bundle stores no diagnosis (it was written by Recorder(..., diagnose=False), or the in-process replay failed); "
                "run `nanreplay report` without --no-replay to replay the step.", EXIT_REPLAY)
    else:
        diag = _replay_with_status(bundle, model_factory=model_factory, loss_fn=loss_fn, device=device, ops=not no_ops, use_loss_fn=not no_loss_fn,
                                   allow=list(allow), default_allow=not no_default_allow, samples=not no_samples,
                                   trust=trust, batch_types=_import_types(batch_types), sandbox=_limits(timeout, memory_limit))
        meta = _guard(lambda: _bundle_meta(bundle))
    out = output if output is not None else bundle.with_suffix(".html")
    try:
        page = render_html(diag, meta=meta, bundle_name=bundle.name)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        if not no_replay:
            raise
        raise CLIError(f"{bundle}: the stored diagnosis is malformed: expected the fields of docs/report.md, found {type(e).__name__}: {e}; "
                       "run `nanreplay report` without --no-replay to replay the step instead", EXIT_BAD_BUNDLE) from e
    _write_page(out, page)
    st = styler(color is not False)
    click.echo(st(inert(diag.get("summary", ""), one_line=True), bold=True), color=color)
    click.echo(f"report written to {st(inert(out), fg='cyan')} ({out.stat().st_size // 1024} KiB)" + (" from the stored diagnosis" if no_replay else ""), color=color)
    if open_browser:
        click.launch(str(out))
    if not reproduced(diag):
        sys.exit(EXIT_NOT_REPRODUCED)



@main.command("log")
@_bundle_arg
@click.option("--to", "to", multiple=True, required=True, metavar="KIND:TARGET",
              help="tensorboard:DIR, wandb:PROJECT or mlflow:URI (repeat it for several trackers).")
@click.option("--run", "run_id", metavar="RUN_ID", help="Log into this existing W&B or MLflow run instead of a new one named after the bundle.")
def log_(bundle: Path, to: tuple[str, ...], run_id: Optional[str]) -> None:
    """Log BUNDLE's verdict to an experiment tracker after the fact, as the Recorder's log_to
    does live: the sentence as text, the step, phase, cause (or spike score) as scalars and tags,
    and, where the tracker keeps artifacts, the bundle and the HTML report (docs/trackers.md).

    Uses the diagnosis stored in the bundle: nothing is replayed and no code the bundle names
    runs, so an untrusted bundle is safe. Exit 0 when logged; 2 for a malformed --to, a tracker
    library that is not installed (pip install 'nanreplay[trackers]') or a tracker that refused
    the log; 4 for a bad bundle.
    """
    from .capture.trackers import Trackers, event_from_meta, open_tracker, parse_spec

    for spec in to:
        try:
            parse_spec(spec)
        except ValueError as e:
            raise CLIError(str(e), EXIT_USAGE) from e
    event = event_from_meta(bundle, _guard(lambda: _bundle_meta(bundle)))
    for spec in to:
        try:
            obj, close = open_tracker(spec, run_name=bundle.stem, run_id=run_id)
        except MissingExtraError as e:
            raise CLIError(str(e), EXIT_USAGE) from e
        except Exception as e:  # the tracker's own error: a directory that cannot be made, a refused URI
            raise CLIError(f"--to {spec}: the tracker could not be opened ({type(e).__name__}: {e}); pass another target", EXIT_USAGE) from e
        trackers = Trackers(obj)
        try:
            trackers.emit(event)
        finally:
            close()
        if trackers.failures:
            raise CLIError(f"--to {spec}: the tracker refused the log ({trackers.failures[0][1]}); pass another target", EXIT_USAGE)
        click.echo(f"{inert(bundle)}: step {event.step}'s {event.kind} verdict logged to {inert(spec)}: {inert(event.sentence, one_line=True)}")

@main.command()
@click.argument("bundles", nargs=-1, required=True, callback=_bundle_files, type=click.Path(dir_okay=True, path_type=Path))
@click.option("--revoke", is_flag=True, help="Remove the bundles from the trust store instead.")
def trust(bundles: tuple[Path, ...], revoke: bool) -> None:
    """Trust BUNDLES: let replay, report and bisect run the code they name (model factory, model
    class, loss function, optimizer class, batch types), as long as their content is unchanged.

    Review what a bundle names first (`nanreplay inspect BUNDLE` lists it). Bundles your own
    Recorder wrote on this machine are trusted already. The trust store is per user
    ($NANREPLAY_HOME, default ~/.nanreplay); see docs/security.md.
    """
    from .format.bundle import trust_bundle, untrust_bundle

    for b in bundles:
        if revoke:
            was = _guard(lambda b=b: untrust_bundle(b))
            click.echo(f"{inert(b)}: {'no longer trusted' if was else 'was not trusted'}")
            continue
        code = _guard(lambda b=b: trust_bundle(b))
        click.echo(f"{inert(b)}: trusted; replay may now run {_code_listing(code) or 'no code'}")


def entry() -> None:
    """The ``nanreplay`` command: :func:`main` in a process whose heap keeps freed memory for the
    replays' reuse (:func:`nanreplay.core.allocator.keep_freed_memory`; fewer page faults) and
    that ends without the interpreter's teardown (:func:`_end_process`). Only the command's own
    process: ``main`` called in-process (tests, ``CliRunner``) leaves the caller's allocator and
    exit alone."""
    from .core.allocator import keep_freed_memory
    from .engine.sandbox import fresh_process

    keep_freed_memory()
    fresh_process()  # nothing has computed yet: a sandboxed replay's child may keep torch's intra-op threads
    try:
        main()
        code: Any = 0
    except SystemExit as e:  # click's standalone mode ends every command so
        code = e.code
    _end_process(code)


def _end_process(code: Any) -> None:
    """End the command's process with exit status ``code`` (``SystemExit``'s: ``None``, an int,
    or a message for stderr and status 1), skipping the interpreter's teardown: the ``atexit``
    handlers run (logging's flush, temporary files' cleanup) and the standard streams are flushed,
    then ``os._exit`` ends the process without freeing each object and module one by one. After a
    replay that teardown frees the model, its weights and torch's modules: 1.0-1.1 s of a 7.4 s
    ``nanreplay replay`` of a 42M-parameter bundle, 0.5 s after only ``import torch``
    (``/usr/bin/time``, this machine). Where another non-daemon thread still runs, the ordinary
    exit (which waits for it) is kept."""
    import atexit

    if isinstance(code, str):
        click.echo(code, err=True)
        code = 1
    code = 0 if code is None else code
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (``| head``), a closed stream
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":  # pragma: no cover
    entry()

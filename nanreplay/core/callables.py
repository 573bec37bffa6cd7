"""Callables named by an import path: ``"pkg.module:qualname"`` or ``"/path/to/file.py:qualname"``.

:func:`callable_path` turns a function or class into such a path (stored in a bundle);
:func:`import_callable` imports one back. Importing runs the module's top-level code: only paths
the user gave, or paths from a bundle the user trusts, are imported (see ``docs/security.md``).

A path is a ``str``; :func:`callable_path` returns a :class:`CallablePath`, a ``str`` that also
knows where the callable was found when recording: ``root``, the ``sys.path`` directory its
module was imported from (a ``model.py`` next to the training script: replay adds it when the
module is not importable otherwise), and ``script``, the training script itself when the
callable lives in ``__main__`` (:func:`import_callable` refuses to import a script that runs
code at import, such as a training loop without an ``if __name__ == "__main__":`` guard, unless
:func:`script_imports` allows it). A bundle stores the path as before and these two facts beside
it (``meta["callables"]``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..errors import ReplayError

logger = logging.getLogger(__name__)

__all__ = [
    "CallablePath",
    "callable_path",
    "callable_record",
    "bind_recorded",
    "loss_kwargs_names",
    "import_callable",
    "import_paths_in",
    "model_init_names",
    "looks_like_import_path",
    "script_imports",
    "script_runs_code",
    "torch_optimizer_class",
]


class CallablePath(str):
    """An import path (the ``str`` itself) plus where it was found when recording.

    Attributes:
        root: absolute ``sys.path`` directory the callable's module was imported from, or
            ``None`` (a module of an installed package, or unknown).
        script: absolute path of the ``__main__`` script the callable was defined in when
            recording, or ``None``.
    """

    root: Optional[str]
    script: Optional[str]

    def __new__(cls, path: str, *, root: Optional[str] = None, script: Optional[str] = None) -> "CallablePath":
        obj = super().__new__(cls, path)
        obj.root, obj.script = root, script
        return obj

    def extras(self) -> Optional[dict]:
        """The JSON record of ``root``/``script`` (``None`` when both are unknown)."""
        rec = {k: v for k, v in (("root", self.root), ("script", self.script)) if v}
        return rec or None

    @classmethod
    def of(cls, path: Optional[str], extras: Any) -> Optional[str]:
        """``path`` with the ``extras`` a bundle stored beside it (a plain ``str`` without)."""
        if path is None or not isinstance(extras, dict):
            return path
        root, script = extras.get("root"), extras.get("script")
        return cls(path, root=root if isinstance(root, str) else None, script=script if isinstance(script, str) else None)


_ALLOW_SCRIPTS: list[bool] = [False]


@contextlib.contextmanager
def script_imports(allow: bool = True) -> Iterator[None]:
    """Within this block, :func:`import_callable` may import a script that runs code at import
    (a training script without a ``__main__`` guard; it logs a warning). ``allow=False`` leaves
    the current setting as it is. ``replay(..., import_script=True)``, ``nanreplay replay
    --import-script``."""
    _ALLOW_SCRIPTS.append(bool(allow) or _ALLOW_SCRIPTS[-1])
    try:
        yield
    finally:
        _ALLOW_SCRIPTS.pop()


def callable_path(fn: Any) -> Optional[str]:
    """``module:qualname`` of a function or class when its module can be imported by name again,
    else ``/path/to/file.py:qualname`` (functions of the ``__main__`` script, of files loaded by
    path, of replay's own file imports); ``None`` for lambdas, closures and objects without a
    source file. A string is returned unchanged.

    The result is a :class:`CallablePath` that also records the module's ``sys.path`` root
    (for a module outside the installed packages) or, for the ``__main__`` script, its path."""
    if fn is None:
        return None
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None)
    if not mod or not qual or "<" in qual:
        return None
    if _importable_by_name(mod):
        return CallablePath(f"{mod}:{qual}", root=_import_root(mod))
    file = getattr(sys.modules.get(mod), "__file__", None)
    if file is None:  # a module loaded by path without registering it: its code still knows its file
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__init__", None), "__code__", None)
        file = getattr(code, "co_filename", None)
    if not file or not os.path.isfile(file):
        return None
    file = os.path.abspath(file)
    return CallablePath(f"{file}:{qual}", script=file if mod == "__main__" else None)


def callable_record(fn: Any) -> tuple[Optional[str], Optional[dict]]:
    """How a bundle records the callable ``fn``: ``(import path, keyword arguments)``, the
    arguments a JSON object (or ``None``), so that replay in another process calls
    ``import_callable(path)(*args, **kwargs)``:

    * ``functools.partial(fn, **kwargs)`` of a function with an import path, with keyword
      arguments only, each a JSON value: its function's path and those arguments;
    * an object whose ``nanreplay_callable`` attribute is such a pair (a callable that holds live
      state in the recording process and says how it is rebuilt without it, e.g. the Hugging Face
      callback's ``TrainerLoss``);
    * anything else: ``(callable_path(fn), None)``.

    A partial or pair whose arguments are not JSON is recorded as ``(None, None)`` (nothing
    replay could rebuild), with an info log."""
    if fn is None or isinstance(fn, str):
        return fn, None
    pair = getattr(fn, "nanreplay_callable", None)
    if pair is None and isinstance(fn, functools.partial) and not fn.args:
        pair = (callable_path(fn.func), dict(fn.keywords))
    if pair is None:
        return callable_path(fn), None
    path, kwargs = pair
    try:
        kwargs = json.loads(json.dumps(kwargs or {}, allow_nan=False))
    except (TypeError, ValueError) as e:
        logger.info("nanreplay: %r's keyword arguments are not JSON (%s); the bundle records no import path for it", fn, e)
        return None, None
    return (path, kwargs or None) if path else (None, None)


def bind_recorded(fn: Callable, kwargs: Optional[dict]) -> Callable:
    """``fn`` with a bundle's recorded keyword arguments bound (:func:`callable_record`)."""
    return functools.partial(fn, **kwargs) if kwargs else fn


def loss_kwargs_names(kwargs: Any) -> dict[str, list[str]]:
    """What calling a bundle's loss function with its recorded keyword arguments
    (``meta["loss_fn_kwargs"]``) may import, by kind: every import path among them, e.g.
    ``{"imported by the loss function (loss_fn_kwargs.trainer_class)": ["train:MyTrainer"]}``."""
    if not isinstance(kwargs, dict):
        return {}
    return {f"imported by the loss function ({where})": names for where, names in import_paths_in(kwargs, "loss_fn_kwargs").items()}


def _installed_dirs() -> set[Path]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError, OSError):
            dirs.add(Path(sysconfig.get_paths()[key]).resolve())
    return dirs


def _import_root(mod: str) -> Optional[str]:
    """The ``sys.path`` directory ``mod`` was imported from (``/dir`` for ``/dir/pkg/sub.py``
    imported as ``pkg.sub``), or ``None`` for modules of the installed packages / stdlib."""
    file = getattr(sys.modules.get(mod), "__file__", None)
    if not file:
        return None
    p = Path(file).resolve()
    if p.stem == "__init__":
        p = p.parent
    root = p
    for _ in mod.split("."):
        root = root.parent
    installed = _installed_dirs()
    if root in installed or any(d in root.parents for d in installed):
        return None
    return str(root)


def torch_optimizer_class(path: Any) -> Optional[type]:
    """The ``torch.optim`` optimizer class a recorded path names (``"torch.optim.adam:Adam"``),
    looked up as an attribute of the already imported ``torch.optim`` (nothing is imported), or
    ``None`` when the path names anything else. Safe on untrusted input: a bundle may name these
    without being trusted.
    """
    if not isinstance(path, str):
        return None
    module, sep, qual = path.partition(":")
    if not sep or not qual.isidentifier() or not (module == "torch.optim" or module.startswith("torch.optim.")):
        return None
    import torch.optim

    cls = getattr(torch.optim, qual, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer):
        return None
    if not (cls.__module__ == module or module == "torch.optim") or not cls.__module__.startswith("torch.optim"):
        return None
    return cls


def looks_like_import_path(text: Any) -> bool:
    """Whether ``text`` has the shape :func:`import_callable` imports: ``pkg.module:qual.name``
    or ``path/to/file.py:qualname`` (nothing is imported; a string that merely looks like one
    counts, since a review must rather show too much than too little)."""
    if not isinstance(text, str):
        return False
    mod, sep, qual = text.rpartition(":")
    if not sep or not mod or not qual or not all(p.isidentifier() for p in qual.split(".")):
        return False
    if mod.endswith(".py") or "/" in mod or "\\" in mod:
        return True
    return all(p.isidentifier() for p in mod.split("."))


#: keys whose string value a builder imports whatever its shape (``model_from_config``'s class)
_CLASS_KEYS = frozenset({"model_class"})


def import_paths_in(obj: Any, where: str = "") -> dict[str, list[str]]:
    """Every string inside the JSON value ``obj`` that a builder could import: those shaped like
    an import path (:func:`looks_like_import_path`) and the value of a ``model_class`` key, by
    their JSON path (``where.kwargs.model_class``, ``where.items[2]``), in document order.
    Nothing is imported. Used to list, for review, what a bundle's ``model_init`` arguments
    name (``Bundle.named_code``)."""
    found: dict[str, list[str]] = {}
    stack: list[tuple[str, Any, bool]] = [(where, obj, False)]
    while stack:  # every node: the manifest's size bounds the walk, and a review must not skip any
        path, node, is_class = stack.pop()
        if isinstance(node, str):
            if is_class or looks_like_import_path(node):
                found.setdefault(path, []).append(node)
        elif isinstance(node, dict):
            for k, v in reversed(list(node.items())):
                key = str(k)
                step = f".{key}" if key.isidentifier() and key.isascii() else f"[{json.dumps(key)}]"  # a key cannot break the line
                stack.append(((path + step).lstrip("."), v, key in _CLASS_KEYS))
        elif isinstance(node, (list, tuple)):
            for i in reversed(range(len(node))):
                stack.append((f"{path}[{i}]", node[i], is_class))
    return found


#: the kind of what a ``model_init`` entry names, as a review and a refusal list it
MODEL_INIT_KIND = "model class (model_init)"


def model_init_names(init: Any) -> dict[str, list[str]]:
    """What building a bundle's ``model_init`` entry (``{"class": ..., "kwargs": {...}}``) would
    import, by kind: the class, then every import path in its arguments, e.g.
    ``{"model class (model_init)": ["nanreplay.integrations.transformers:model_from_config"],
    "imported by the model class (model_init.kwargs.model_class)": ["pkg.models:Net"]}``."""
    if not isinstance(init, dict) or not init.get("class"):
        return {}
    out = {MODEL_INIT_KIND: [init["class"]]}
    kwargs = init.get("kwargs") or {}
    for where, names in import_paths_in(kwargs, "model_init.kwargs").items():
        out[f"imported by the model class ({where})"] = names
    return out


def _importable_by_name(mod: str) -> bool:
    if mod == "__main__" or mod.startswith("nanreplay_user_"):
        return False
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def script_runs_code(file: str | Path) -> Optional[str]:
    """Why importing the script ``file`` would run more than definitions (``"line 12: _ =
    setup()"``), or ``None`` when its top level only imports modules, defines functions and
    classes and assigns values computed without a call. Code runs at import when a top-level
    statement calls anything (:func:`_call_at_import`: ``_ = call()``, a decorator, a default
    argument, a base class, a class body, a comprehension), loops, opens a ``with`` or ``try``
    block, or branches on anything but ``__name__ == "__main__"``. Unparseable files count as
    running code."""
    try:
        src = Path(file).read_text(encoding="utf-8")
        tree = ast.parse(src, filename=str(file))
    except (OSError, SyntaxError, ValueError) as e:
        return f"it cannot be parsed ({type(e).__name__})"
    lazy = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names) for n in tree.body)
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            continue
        culprit = _runs_at_import(node, lazy_annotations=lazy)
        if culprit is None:
            continue
        lines = src.splitlines()
        line = lines[culprit.lineno - 1].strip() if 0 < culprit.lineno <= len(lines) else type(culprit).__name__
        return f"line {culprit.lineno}: {line[:80]}"
    return None


def _calls(nodes: Any) -> Optional[ast.AST]:
    """The first call among the expressions ``nodes`` (``None`` entries skipped) that runs when
    they are evaluated: lambda bodies are not evaluated, comprehensions are."""
    todo = [n for n in (nodes if isinstance(nodes, list) else [nodes]) if n is not None]
    while todo:
        n = todo.pop(0)
        if isinstance(n, ast.Call):
            return n
        if isinstance(n, ast.Lambda):
            todo.extend(n.args.defaults + [d for d in n.args.kw_defaults if d is not None])
            continue
        todo.extend(ast.iter_child_nodes(n))
    return None


def _runs_at_import(node: ast.stmt, *, lazy_annotations: bool) -> Optional[ast.AST]:
    """The part of the top-level (or class-body) statement ``node`` that runs code when the
    module is imported, or ``None`` when it only defines, imports or assigns without a call."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
        return None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return None  # a docstring
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.decorator_list:
            return node.decorator_list[0]  # a decorator is called at import
        a = node.args
        annotations = [] if lazy_annotations else [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None] + [node.returns]
        return _calls(a.defaults + [d for d in a.kw_defaults if d is not None] + annotations)
    if isinstance(node, ast.ClassDef):
        if node.decorator_list:
            return node.decorator_list[0]
        if any(k.arg == "metaclass" for k in node.keywords):
            return node  # the metaclass is called at import
        found = _calls(node.bases + [k.value for k in node.keywords])
        if found is not None:
            return found
        for stmt in node.body:  # a class body runs at import
            found = _runs_at_import(stmt, lazy_annotations=lazy_annotations)
            if found is not None:
                return found
        return None
    if isinstance(node, ast.Assign):
        return _calls(node.targets + [node.value])
    if isinstance(node, ast.AugAssign):
        return _calls([node.target, node.value])
    if isinstance(node, ast.AnnAssign):
        return _calls([node.target, node.value] + ([] if lazy_annotations else [node.annotation]))
    return node  # loops, with, try, if, expressions, raise, del...


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def _check_script(path: str, file: Path, *, recorded_main: bool) -> Optional[Any]:
    """For a callable in a file: the running ``__main__`` module when ``file`` is it (nothing to
    import), else ``None`` after checking that importing the file does not run its code (a
    training loop without a ``__main__`` guard): refused unless :func:`script_imports` allows it."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file and Path(main_file).resolve() == file.resolve():
        return main
    why = script_runs_code(file)
    if why is None:
        return None
    if not _ALLOW_SCRIPTS[-1]:
        what = "the training script (__main__) when recording" if recorded_main else "a script"
        raise ReplayError(
            f"{path!r} lives in {file}, {what}, and importing it runs its code "
            f"({why}), which would start the training again (or run whatever else it calls). Fix: replay from the bundle's embedded program (replay "
            f"uses it when the bundle has one), pass --model-factory / --loss-fn naming a module without side effects, "
            f"put the script's training under `if __name__ == \"__main__\":`, or pass --import-script to import it anyway"
        )
    logger.warning("nanreplay: importing %s, the recorded training script, runs its top-level code (%s)", file, why)
    return None


def _add_root(root: Optional[str], mod_name: str) -> bool:
    """Put a recorded ``sys.path`` root on ``sys.path`` (last: it never shadows a module that
    imports already) when ``mod_name`` does not import without it; True when it was added."""
    if not root or not os.path.isdir(root):
        return False
    top = mod_name.partition(".")[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return False
    except (ImportError, ValueError):
        pass
    if root not in sys.path:
        sys.path.append(root)  # kept: the callable may import its siblings lazily when called
        logger.info("nanreplay: added %s (where %s was imported from when recording) to sys.path", root, mod_name)
        return True
    return False


def _import_hint(path: str, mod_name: str, root: Optional[str]) -> str:
    top = mod_name.partition(".")[0]
    if root and not os.path.isdir(root):
        return (f"; it was imported from {root} when recording, which does not exist here. Fix: run where {top} is "
                f"importable (PYTHONPATH=<the directory holding {top}>), or pass --model-factory /path/to/file.py:function")
    if root:
        return (f"; it was imported from {root} when recording, and is not importable from there now. Fix: "
                f"PYTHONPATH=<the directory holding {top}>, or pass --model-factory /path/to/file.py:function")
    return (f"; {top} is not on sys.path here. If it sits next to your training script, run from that directory with "
            f"PYTHONPATH=., or pass --model-factory /path/to/file.py:function")


def import_callable(path: str) -> Callable:
    """Import ``"pkg.module:attr"`` or ``"/path/to/file.py:attr"`` (dotted attrs allowed).

    A file is imported under a private module name, so its ``if __name__ == "__main__":`` block
    does not run. This runs user code: replay only bundles whose model code you trust.

    A file that is the running ``__main__`` script is not imported again (its module is used);
    any other file is imported only when it does not run code at import
    (:func:`script_runs_code`: an unguarded training loop would train again) or
    :func:`script_imports` allows it. With a :class:`CallablePath`, a module that does not
    import is looked for in the recorded ``root`` too.

    Raises:
        ReplayError: malformed path, missing file or module (the message names the recorded
            directory and ``PYTHONPATH``), missing attribute, or a training script that would
            run again.
    """
    mod_name, sep, qual = path.rpartition(":")
    if not sep or not mod_name or not qual:
        raise ReplayError(f"expected an import path 'package.module:function' or 'file.py:function', got {path!r}")
    root = getattr(path, "root", None)
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            file = Path(mod_name)
            if not file.is_file():
                raise ReplayError(f"{path!r}: no file {file}; pass --model-factory / --loss-fn with a path that exists here")
            name = "nanreplay_user_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
            module = _check_script(path, file, recorded_main=bool(getattr(path, "script", None)))
            if module is None:
                module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, file)
                if spec is None or spec.loader is None:
                    raise ReplayError(f"{path!r}: {file} is not an importable Python file")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                sys.path.insert(0, str(file.resolve().parent))
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
        else:
            _add_root(root, mod_name)
            module = importlib.import_module(mod_name)
        obj: Any = module
        for part in qual.split("."):
            obj = getattr(obj, part)
    except ReplayError:
        raise
    except ModuleNotFoundError as e:
        hint = _import_hint(path, mod_name, root) if e.name and mod_name.startswith(e.name.partition(".")[0]) else ""
        raise ReplayError(f"could not import {path!r}: {type(e).__name__}: {e}{hint}") from e
    except Exception as e:
        raise ReplayError(f"could not import {path!r}: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ReplayError(f"{path!r} names a {type(obj).__name__}, expected a callable")
    return obj

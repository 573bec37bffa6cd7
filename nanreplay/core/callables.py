"""Callables named by an import path: ``"pkg.module:qualname"`` or ``"/path/to/file.py:qualname"``.

:func:`callable_path` turns a function or class into such a path (stored in a bundle);
:func:`import_callable` imports one back. Importing runs the module's top-level code: only paths
the user gave, or paths from a bundle the user trusts, are imported (see ``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import ReplayError

__all__ = ["callable_path", "import_callable", "torch_optimizer_class"]


def callable_path(fn: Any) -> Optional[str]:
    """``module:qualname`` of a function or class when its module can be imported by name again,
    else ``/path/to/file.py:qualname`` (functions of the ``__main__`` script, of files loaded by
    path, of replay's own file imports); ``None`` for lambdas, closures and objects without a
    source file. A string is returned unchanged."""
    if fn is None:
        return None
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None)
    if not mod or not qual or "<" in qual:
        return None
    if _importable_by_name(mod):
        return f"{mod}:{qual}"
    file = getattr(sys.modules.get(mod), "__file__", None)
    if file is None:  # a module loaded by path without registering it: its code still knows its file
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__init__", None), "__code__", None)
        file = getattr(code, "co_filename", None)
    return f"{os.path.abspath(file)}:{qual}" if file and os.path.isfile(file) else None


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


def _importable_by_name(mod: str) -> bool:
    if mod == "__main__" or mod.startswith("nanreplay_user_"):
        return False
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def import_callable(path: str) -> Callable:
    """Import ``"pkg.module:attr"`` or ``"/path/to/file.py:attr"`` (dotted attrs allowed).

    A file is imported under a private module name, so its ``if __name__ == "__main__":`` block
    does not run. This runs user code: replay only bundles whose model code you trust.

    Raises:
        ReplayError: malformed path, missing file or module, or missing attribute.
    """
    mod_name, sep, qual = path.rpartition(":")
    if not sep or not mod_name or not qual:
        raise ReplayError(f"expected an import path 'package.module:function' or 'file.py:function', got {path!r}")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            file = Path(mod_name)
            if not file.is_file():
                raise ReplayError(f"{path!r}: no file {file}; pass --model-factory / --loss-fn with a path that exists here")
            name = "nanreplay_user_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
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
            module = importlib.import_module(mod_name)
        obj: Any = module
        for part in qual.split("."):
            obj = getattr(obj, part)
    except ReplayError:
        raise
    except Exception as e:
        raise ReplayError(f"could not import {path!r}: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ReplayError(f"{path!r} names a {type(obj).__name__}, expected a callable")
    return obj

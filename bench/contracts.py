"""Which allowlisted ops read past a tensor argument whose shape is smaller than they expect?

For every op of the allowlist (``nanreplay/engine/opset.py``) that torch's own test suite describes
(its ``OpInfo`` database, ``torch.testing._internal.common_methods_invocations.op_db``: sample
inputs for each op), each sample is called again with one tensor argument one element shorter in
one dimension, placed at the start of a larger buffer. A kernel that checks the shapes raises; one
that returns is called a second time after the buffer *beyond* the argument was overwritten: if
the result changed, the kernel read outside the argument (a heap read, in a real replay). Each op
runs in a forked child (a crash is reported as such, not suffered). What it finds belongs in
``nanreplay.engine.bounds.SHAPE_CONTRACTS`` (a shape the verifier checks before the op runs) or,
for an index value, in ``nanreplay.engine.guards.INDEX_CHECKS``; ops that mutate an argument
(``embedding_bag`` with ``max_norm`` renormalises its weight) or allocate without initialising
(``empty_like``) change between calls for other reasons and are listed as such.

Needs ``expecttest`` (torch's test suite imports it): ``pip install expecttest``.
Run: ``python bench/contracts.py [--samples 40]`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nanreplay.engine import opset  # noqa: E402

PAD = 4096
#: ops whose results differ between two calls by design (uninitialized outputs)
UNINITIALIZED = {"empty_like", "new_empty", "new_empty_strided", "empty", "empty_strided"}


def _leaves(x: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))


def _replace(x: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    if isinstance(x, (list, tuple)):
        items = list(x)
        items[path[0]] = _replace(items[path[0]], path[1:], new)
        return type(x)(items) if isinstance(x, tuple) else items
    d = dict(x)
    d[path[0]] = _replace(d[path[0]], path[1:], new)
    return d


def _same(a: Any, b: Any) -> bool:
    la, lb = list(_leaves(a)), list(_leaves(b))
    if len(la) != len(lb):
        return False
    for (_, x), (_, y) in zip(la, lb):
        if x.shape != y.shape:
            return False
        if x.is_floating_point() or x.is_complex():
            x, y = torch.nan_to_num(x.detach(), 7.0, 8.0, 9.0), torch.nan_to_num(y.detach(), 7.0, 8.0, 9.0)
        if not torch.equal(x, y):
            return False
    return True


def _fills(dtype: torch.dtype) -> tuple:
    if dtype == torch.bool:
        return False, True
    return (3.0, -5.0) if dtype.is_floating_point or dtype.is_complex else (0, 1)


def _probe(info: Any, samples: int) -> list:
    """The (argument path, shape, shortened shape) whose shortening made the result depend on the
    memory after the argument."""
    found = []
    for si in itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=False), samples):
        tree = ([si.input, *si.args], dict(si.kwargs))
        for path, t in list(_leaves(tree)):
            for d in range(t.dim()):
                if t.shape[d] < 2:
                    continue
                shape = list(t.shape)
                shape[d] -= 1
                n = torch.Size(shape).numel()
                f1, f2 = _fills(t.dtype)
                buf = torch.empty(n + PAD, dtype=t.dtype)
                buf[:n] = t.reshape(-1)[:n]
                buf[n:] = f1
                args, kwargs = _replace(tree, path, buf[:n].view(shape))
                try:
                    torch.manual_seed(0)
                    first = info.op(*args, **kwargs)
                except Exception:  # noqa: BLE001 - the kernel checks its shapes: fine
                    continue
                buf[n:] = f2
                try:
                    torch.manual_seed(0)
                    second = info.op(*args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    found.append((str(path), list(t.shape), shape, f"second call raised {type(e).__name__}"))
                    continue
                if not _same(first, second):
                    found.append((str(path), list(t.shape), shape, "reads past the argument"))
    return found


def _in_child(info: Any, samples: int) -> Any:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(120)
        try:
            res: Any = _probe(info, samples)
        except Exception as e:  # noqa: BLE001
            res = f"probe failed: {type(e).__name__}: {str(e)[:100]}"
        os.write(w, json.dumps(res, default=str).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"crashed (signal {os.WTERMSIG(status)})"
    return json.loads(data) if data else "no result"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40, help="sample inputs per op")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # fork-safe
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as e:
        print(f"torch's OpInfo database needs a test dependency ({e}): pip install expecttest", file=sys.stderr)
        return 2
    allowed = {n.partition(".")[0] for n in opset.OPS}
    probed, findings = 0, {}
    for info in op_db:
        name = info.name.split(".")[-1]
        if (name not in allowed and (info.aten_name or "") not in allowed) or name in UNINITIALIZED:
            continue
        probed += 1
        res = _in_child(info, args.samples)
        if res:
            findings[info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")] = res
    print(f"torch {torch.__version__}: {probed} OpInfos of allowlisted ops probed, {args.samples} samples each, every tensor argument "
          f"shortened by one in each dimension; {len(findings)} with findings")
    for name, res in findings.items():
        if isinstance(res, str):
            print(f"  {name}: {res}")
            continue
        shown = sorted({(p, tuple(s), tuple(t), what) for p, s, t, what in res})[:4]
        print(f"  {name}: " + "; ".join(f"argument {p} {list(s)} -> {list(t)}: {what}" for p, s, t, what in shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())

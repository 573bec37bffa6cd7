"""A reproducer anyone can run: the origin op of a bundle's failing step, alone, with the inputs it
had (``nanreplay export BUNDLE --repro DIR``), for an upstream bug report or a unit test.

:func:`export_repro` replays the step, takes the origin the diagnosis names (an aten op in the
forward pass, the loss or a backward kernel), finds that call again in a plain replay
(:func:`nanreplay.engine.rewrite.locate`; for a birth in a backward kernel, the forward call whose
autograd node it ran in) and captures its arguments (:func:`~nanreplay.engine.rewrite.capture`; for
a backward birth also the gradient flowing into the node). :func:`write_repro` writes them as

* ``op_inputs.safetensors``: the tensors (``arg0``, ``arg1``, ... in argument order;
  ``grad_output0``, ... for a backward birth; complex tensors as their real view), on the CPU;
* ``repro.py``: a standalone script that needs only torch (it reads the safetensors file with its
  own 20-line reader), calls the op, for a backward birth ``torch.autograd.grad`` with the
  recorded output gradient, prints what the inputs and the result hold, and exits 0 when the
  result holds NaN/Inf (reproduced) and 1 when it is finite.

Bundles are data: the op is written into the script only when its exact overload is on the
reviewed allowlist of :mod:`nanreplay.engine.opset`; every other value the script holds (the
source line, the op's non-tensor arguments) is written with ``repr()`` of a plain Python value
whose type is checked first, never pasted as code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.state import load_buffers
from ..engine.opset import allowed
from ..engine.rewrite import OpCall, OpTarget, capture, locate
from ..engine.sandbox import SandboxLimits, conforming, sandbox_plan
from ..engine.state import ReplayRequest, load_state, opened_subject
from ..errors import ReplayError, SandboxError
from ..format.bundle import Bundle, Types
from .api import Progress, bundle_step_inputs, replay_step

__all__ = ["export_repro", "write_repro", "call_payload", "call_from_payload", "SCRIPT", "TENSORS"]

#: the names of the files :func:`write_repro` writes
SCRIPT, TENSORS = "repro.py", "op_inputs.safetensors"

_SAFE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _silent(message: str) -> None:
    return None


class _Literal:
    """Python source for an op argument: plain values by ``repr()``, tensors as ``t('argN')``."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.complex: list[str] = []

    def tensor(self, x: torch.Tensor, prefix: str) -> str:
        name = f"{prefix}{len([k for k in self.tensors if k.startswith(prefix)])}"
        x = x.detach().to("cpu").contiguous()
        if x.is_complex():
            self.complex.append(name)
            x = torch.view_as_real(x).contiguous()
        self.tensors[name] = x
        return f"t({name!r})"

    def __call__(self, x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return self.tensor(x, "arg")
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        if isinstance(x, float):
            return repr(x) if math.isfinite(x) else f"float({repr(x)!r})"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        if isinstance(x, torch.dtype):
            return _torch_attr(str(x).replace("torch.", ""), torch.dtype)
        if isinstance(x, torch.device):
            return "torch.device('cpu')"
        if isinstance(x, (torch.memory_format, torch.layout)):
            return _torch_attr(str(x).replace("torch.", ""), type(x))
        raise ReplayError(f"expected the op's arguments to be tensors or plain values (None, bool, int, float, str, lists, dtypes), "
                          f"found {type(x).__name__}; the reproducer is not written")


def _torch_attr(name: str, kind: type) -> str:
    if not name or set(name) - _SAFE_NAME_CHARS or not isinstance(getattr(torch, name, None), kind):
        raise ReplayError(f"expected a torch {kind.__name__}, found {name!r}; the reproducer is not written")
    return f"getattr(torch, {name!r})"


def _checked_op(call: OpCall) -> tuple[str, str]:
    """``(packet, overload)`` of the call, refused unless ``packet.overload`` is on the allowlist."""
    packet, overload = str(call.name), str(getattr(call.func, "_overloadname", "default") or "default")
    full = f"{packet}.{overload}"
    if not allowed(full) or set(packet) - _SAFE_NAME_CHARS or set(overload) - _SAFE_NAME_CHARS:
        raise ReplayError(f"expected an aten op on nanreplay's reviewed allowlist (nanreplay/engine/opset.py), found {full!r}; "
                          "the reproducer is not written (a bundle is data: an op outside the allowlist is never written into a script)")
    return packet, overload


_TEMPLATE = '''#!/usr/bin/env python3
"""A reproducer written by `nanreplay export --repro`: one aten op on the inputs it had when it
gave birth to a non-finite value in a recorded training step.

    python repro.py        # exit 0: the result holds NaN/Inf (reproduced); 1: it is finite

Needs only torch: the tensors are in the safetensors file beside this script (read below with a
plain safetensors reader). Every value below was written with repr(); nothing is read as code.
"""
import json
import os
import struct
import sys

import torch

OP = {packet!r}
OVERLOAD = {overload!r}
BACKWARD = {backward!r}  # True: the birth was in the op's derivative (autograd.grad with the recorded output gradient)
WHERE = {where!r}
STEP = {step!r}
TENSORS = {tensors_file!r}
COMPLEX = {complex!r}  # tensors stored as their real view (safetensors has no complex dtype)

_DTYPES = {{"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}}


def load(path):
    """The tensors of a safetensors file: 8-byte little-endian header size, a JSON header, the data."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {{}}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        raw = bytearray(data[8 + n + start:8 + n + end])
        x = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = x.reshape(info["shape"])
    return out


T = load(os.path.join(os.path.dirname(os.path.abspath(__file__)), TENSORS))


def t(name):
    return torch.view_as_complex(T[name]) if name in COMPLEX else T[name]


ARGS = {args}
KWARGS = {kwargs}
GRAD_OUTPUTS = {grad_outputs}


def tensors(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in tensors(v)]
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in tensors(v)]
    return []


def floating(x):
    return x.is_floating_point() or x.is_complex()


def describe(x):
    if not floating(x) or x.numel() == 0:
        return f"{{x.dtype}} {{list(x.shape)}}" + (f" values {{x.unique()[:8].tolist()}}" if x.numel() else "")
    fin = x[torch.isfinite(x)]
    counts = {{"NaN": int(torch.isnan(x).sum()), "+Inf": int(torch.isposinf(x.real if x.is_complex() else x).sum()),
              "-Inf": int(torch.isneginf(x.real if x.is_complex() else x).sum()), "zeros": int((x == 0).sum())}}
    if not x.is_complex():
        counts["negatives"] = int((x < 0).sum())
    said = ", ".join(f"{{v}} {{k}}" for k, v in counts.items() if v)
    rng = f", finite range [{{float(fin.abs().min() if x.is_complex() else fin.min()):.6g}}, {{float(fin.abs().max() if x.is_complex() else fin.max()):.6g}}]" if fin.numel() else ""
    return f"{{x.dtype}} {{list(x.shape)}}: {{said or 'all finite, non-zero'}} of {{x.numel()}}{{rng}}"


def main():
    op = getattr(getattr(torch.ops.aten, OP), OVERLOAD)
    print(f"nanreplay reproducer: aten.{{OP}}.{{OVERLOAD}}" + (" and its derivative" if BACKWARD else "") + f" (step {{STEP}}{{', ' + WHERE if WHERE else ''}})")
    print(f"torch {{torch.__version__}}, CPU")
    for i, x in enumerate(tensors((ARGS, KWARGS))):
        print(f"  input {{i}}: {{describe(x)}}")
    if BACKWARD:
        leaves = []

        def lift(x):
            if isinstance(x, torch.Tensor) and floating(x):
                y = x.detach().clone().requires_grad_(True)
                leaves.append(y)
                return y
            if isinstance(x, (list, tuple)):
                return type(x)(lift(v) for v in x)
            return x

        args, kwargs = lift(ARGS), {{k: lift(v) for k, v in KWARGS.items()}}
        with torch.enable_grad():
            outs = tensors(op(*args, **kwargs))
        for i, g in enumerate(GRAD_OUTPUTS):
            if g is not None:
                print(f"  output gradient {{i}}: {{describe(g)}}")
        pairs = [(o, g) for o, g in zip(outs, GRAD_OUTPUTS) if g is not None and o.requires_grad]
        for i, o in enumerate(outs):
            print(f"  output {{i}}: {{describe(o.detach())}}")
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True) if pairs else ()
        results = [g for g in grads if g is not None]
        label = "input gradient"
    else:
        with torch.no_grad():
            results = tensors(op(*ARGS, **KWARGS))
        label = "output"
    bad = False
    for i, r in enumerate(results):
        print(f"  {{label}} {{i}}: {{describe(r)}}")
        bad = bad or (floating(r) and not bool(torch.isfinite(r).all()))
    print("reproduced: the result holds non-finite values" if bad else "not reproduced: the result is finite")
    return 0 if bad else 1


if __name__ == "__main__":
    sys.exit(main())
'''


def write_repro(call: OpCall, out_dir: Union[str, Path], *, step: Optional[int] = None, where: Optional[str] = None) -> dict:
    """Write the reproducer of one captured op call (:func:`nanreplay.engine.rewrite.capture`):
    ``DIR/op_inputs.safetensors`` and ``DIR/repro.py`` (see the module docstring).

    Args:
        call: the call with ``args``/``kwargs`` (and ``grad_outputs`` for a backward birth) captured.
        step: the recorded step, ``where``: its source line (``model.py:25``), both printed by the script.

    Returns:
        ``{"dir", "script", "tensors", "bytes" (of the tensors file), "op", "backward"}``.

    Raises:
        ReplayError: the op's exact overload is not on the allowlist (:func:`nanreplay.engine.opset.allowed`),
            an argument is not a tensor or a plain value, or the call was not captured.
    """
    from safetensors.torch import save_file

    packet, overload = _checked_op(call)
    if call.args is None:
        raise ReplayError(f"expected the arguments of {packet}.{overload} to be captured, found none; the reproducer is not written")
    lit = _Literal()
    args = lit(tuple(call.args))
    kwargs = "{" + ", ".join(f"{str(k)!r}: {lit(v)}" for k, v in (call.kwargs or {}).items()) + "}"
    grads = "[" + ", ".join("None" if g is None else lit.tensor(g, "grad_output") for g in (call.grad_outputs or [])) + "]"
    if call.backward_birth and not call.grad_outputs:
        raise ReplayError(f"expected the gradient flowing into the backward of {packet}.{overload} to be captured, found none; "
                          "the reproducer is not written")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors_path, script_path = out / TENSORS, out / SCRIPT
    save_file(lit.tensors, str(tensors_path), metadata={"op": f"{packet}.{overload}", "writer": "nanreplay export --repro"})
    script = _TEMPLATE.format(packet=packet, overload=overload, backward=bool(call.backward_birth), where=str(where or ""),
                              step=int(step) if isinstance(step, int) else None, tensors_file=TENSORS, complex=sorted(lit.complex),
                              args=args, kwargs=kwargs, grad_outputs=grads)
    compile(script, str(script_path), "exec")  # a script that does not parse is never written
    script_path.write_text(script)
    return {"dir": str(out), "script": str(script_path), "tensors": str(tensors_path), "bytes": tensors_path.stat().st_size,
            "op": f"{packet}.{overload}", "backward": bool(call.backward_birth)}


def export_repro(bundle: Union[str, Path, Bundle], out_dir: Union[str, Path], *, model: Optional[torch.nn.Module] = None,
                 model_factory: Union[str, Callable, None] = None, loss_fn: Union[str, Callable, None] = None,
                 use_loss_fn: bool = True, device: Union[str, torch.device, None] = None, allow: Optional[Sequence[str]] = None,
                 trust: bool = False, batch_types: Types = None, import_script: bool = False,
                 progress: Optional[Progress] = None, sandbox: Optional[SandboxLimits] = None) -> dict:
    """Replay the bundle's failing step, find its origin op and write its reproducer into
    ``out_dir`` (:func:`write_repro`). Options, the trust rule and the sandbox as
    :func:`nanreplay.replay`: an untrusted bundle's program replays in the sandbox, which sends
    back the captured call as data (:func:`call_payload`); this process checks it (the op on the
    allowlist, each argument a plain value or a tensor of the file it sent) and writes the files.

    Returns:
        :func:`write_repro`'s dict, with ``summary`` (the diagnosis's sentence), ``step`` and ``where``.

    Raises:
        ReplayError: the origin is not an op (the batch, the weights, the optimizer update, an
            exploding norm), the replay did not reproduce the failure, or the op is refused
            (:func:`write_repro`); as :func:`nanreplay.replay` otherwise.
    """
    say = progress or _silent
    request = ReplayRequest(model=model, model_factory=model_factory, loss_fn=loss_fn, use_loss_fn=use_loss_fn, device=device, trust=trust,
                            batch_types=batch_types, import_script=import_script)
    with sandbox_plan(bundle, request) as (b, plan):
        if plan is None:
            got, facts = _captured(b, request, allow=allow, progress=say)
        else:
            say("starting the sandboxed replay (the bundle is not trusted)")

            def work(req: ReplayRequest, relay: Progress) -> tuple[dict, dict[str, bytes]]:
                call, info = _captured(b, req, allow=allow, progress=relay)
                data, tensors = call_payload(call)
                return {"call": data, **info}, {TENSORS: tensors}

            data, blobs = plan.run(work, progress=say, limits=sandbox, encode=lambda v: v)
            facts = conforming(data, _FACTS_SCHEMA, plan.path)
            got = call_from_payload(facts.pop("call"), blobs.get(TENSORS, b""))
    out = write_repro(got, out_dir, step=facts["step"], where=facts["where"])
    out.update(facts)
    return out


#: what a sandboxed export sends beside the call (checked by the parent before use)
_FACTS_SCHEMA = {"type": "object", "required": ["call", "summary", "step", "where"], "additionalProperties": False,
                 "properties": {"call": {"type": "object"}, "summary": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                "step": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                "where": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}


def _captured(bundle: Union[str, Path, Bundle], request: ReplayRequest, *, allow: Optional[Sequence[str]], progress: Progress
              ) -> tuple[OpCall, dict]:
    """The origin op's call with its inputs captured, and ``{"summary", "step", "where"}``: the
    replay part of :func:`export_repro` (in this process or in the sandbox's child)."""
    say = progress
    say("rebuilding the model")
    with opened_subject(bundle, request) as (b, subject, dev):
        state = b.state()
        load_state(subject.model, state)
        inp = bundle_step_inputs(b, state, subject.loss_fn, allow=allow)
        diag = replay_step(subject.model, inp, ops=True, device=dev, samples=False, progress=say)
        o = diag.get("origin") or {}
        phase = diag.get("phase")
        if phase not in ("forward", "loss", "backward") or not o.get("op"):
            where = {"none": "the replay produced no non-finite value"}.get(str(phase), f"the origin is {phase!s}, not an op")
            raise ReplayError(f"expected an op to give birth to the non-finite value, found none ({where}): {diag.get('summary')}; "
                              "no reproducer is written")
        load_buffers(subject.model, state.buffers)
        say("finding the origin's call in a plain replay")
        call = locate(subject.model, inp, OpTarget(o.get("op"), phase == "backward", o.get("node")), device=dev)
        load_buffers(subject.model, state.buffers)
        if call is None:
            raise ReplayError(f"expected a plain replay of step {b.failing_step} to make the call that gave birth ({o.get('op')}), "
                              "found none; no reproducer is written")
        say(f"capturing the inputs of {call.overload}")
        got = capture(subject.model, inp, call, device=dev)
        load_buffers(subject.model, state.buffers)
        if got is None:
            raise ReplayError(f"expected to capture the inputs of {call.overload}, found no such call; no reproducer is written")
        src = o.get("source") or {}
        where = f"{Path(str(src['file'])).name}:{src.get('line')}" if src.get("file") else None
        return got, {"summary": diag.get("summary"), "step": b.failing_step, "where": where}


# ------------------------------------------------------------------------------ the call as data

def call_payload(call: OpCall) -> tuple[dict, bytes]:
    """A captured call as JSON data and the bytes of a safetensors file of its tensors: what the
    sandbox's child sends (:func:`call_from_payload` reads it back). Values are tagged:
    ``{"tensor": "arg0"}``, ``{"tuple": [...]}``, ``{"float": "nan"}``, ``{"dtype": "float32"}``,
    ``{"torch": "contiguous_format"}`` (a memory format or layout), ``{"device": "cpu"}``."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, prefix: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"{prefix}{len([k for k in tensors if k.startswith(prefix)])}"
            tensors[name] = x.detach().to("cpu").contiguous()
            return {"tensor": name}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, (list, tuple)):
            items = [enc(v, prefix) for v in x]
            return items if isinstance(x, list) else {"tuple": items}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).replace("torch.", "")}
        if isinstance(x, torch.device):
            return {"device": "cpu"}
        if isinstance(x, (torch.memory_format, torch.layout)):
            return {"torch": str(x).replace("torch.", "")}
        raise ReplayError(f"expected the op's arguments to be tensors or plain values, found {type(x).__name__}; the reproducer is not written")

    packet, overload = _checked_op(call)
    data = {"op": packet, "overload": overload, "backward": bool(call.backward_birth), "name": call.name, "occurrence": int(call.occurrence),
            "args": enc(list(call.args or ()), "arg"), "kwargs": {str(k): enc(v, "arg") for k, v in (call.kwargs or {}).items()},
            "grad_outputs": None if call.grad_outputs is None else [enc(g, "grad_output") for g in call.grad_outputs]}
    complex_ = [k for k, t in tensors.items() if t.is_complex()]
    data["complex"] = complex_
    return data, save({k: torch.view_as_real(t).contiguous() if t.is_complex() else t for k, t in tensors.items()})


def call_from_payload(data: Any, raw: bytes) -> OpCall:
    """The :class:`~nanreplay.engine.rewrite.OpCall` of :func:`call_payload`'s data and tensors,
    checked as untrusted input: the op's exact overload on the allowlist (resolved through
    ``torch.ops.aten``, never by a name the data gives otherwise), every value of a tagged kind,
    every tensor name one the file holds, dtypes and memory formats named torch attributes.

    Raises:
        SandboxError: anything else (a damaged or hostile bundle's child).
    """
    from safetensors.torch import load

    def bad(what: str) -> SandboxError:
        return SandboxError(f"the sandboxed replay sent a reproducer call that does not check ({what}); a damaged or hostile bundle; "
                            "nothing was written")

    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("op", "overload", "name")):
        raise bad("no op named")
    packet, overload = data["op"], data["overload"]
    if not allowed(f"{packet}.{overload}") or set(packet) - _SAFE_NAME_CHARS or set(overload) - _SAFE_NAME_CHARS:
        raise bad(f"{packet[:60]}.{overload[:60]} is not on the allowlist")
    try:
        tensors = load(raw) if raw else {}
    except Exception as e:  # noqa: BLE001 - safetensors' own parser refused the bytes
        raise bad(f"its tensors do not read: {type(e).__name__}") from None
    for name in data.get("complex") or []:
        if name not in tensors or not isinstance(name, str):
            raise bad("an unknown complex tensor")
        tensors[name] = torch.view_as_complex(tensors[name])

    def dec(x: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise bad("arguments nested too deeply")
        if x is None or isinstance(x, (bool, int, str, float)):
            return x
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        if isinstance(x, dict) and len(x) == 1:
            (tag, v), = x.items()
            if tag == "tensor" and isinstance(v, str) and v in tensors:
                return tensors[v]
            if tag == "tuple" and isinstance(v, list):
                return tuple(dec(i, depth + 1) for i in v)
            if tag == "float" and v in ("nan", "inf", "-inf"):
                return float(v)
            if tag == "device" and v == "cpu":
                return torch.device("cpu")
            if tag in ("dtype", "torch") and isinstance(v, str) and not set(v) - _SAFE_NAME_CHARS and v:
                value = getattr(torch, v, None)
                if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
                    return value
        raise bad(f"an argument of an unknown kind {str(x)[:60]!r}")

    args, kwargs, grads = data.get("args"), data.get("kwargs"), data.get("grad_outputs")
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not (grads is None or isinstance(grads, list)):
        raise bad("arguments of the wrong shape")
    occurrence = data.get("occurrence")
    return OpCall(name=packet, occurrence=occurrence if type(occurrence) is int else 1, func=getattr(getattr(torch.ops.aten, packet), overload),
                  backward_birth=data.get("backward") is True, args=tuple(dec(a) for a in args),
                  kwargs={str(k): dec(v) for k, v in kwargs.items()}, grad_outputs=None if grads is None else [dec(g) for g in grads])

"""The replay's monitors: what each module and each aten op did with non-finite values.

* :class:`ModuleMonitor`: module hooks (``register_forward_pre_hook`` / ``register_forward_hook``
  on every module) record each module's input and output health in execution order, and in the
  backward pass the cotangent at each module's output and each parameter's gradient. A module is
  the *producer* when NaN appears in its output while none of its inputs holds NaN, or ±Inf
  appears while all its inputs are finite (:func:`born`); the others only propagate.
* :class:`OpMonitor`: a ``TorchDispatchMode`` with ``torch.utils.module_tracker.ModuleTracker``
  for the module context checks every aten op's floating outputs in the forward pass, the loss
  and the backward pass, and records each *birth* by the same rule, with the evidence observed at
  that moment (:mod:`nanreplay.engine.probes`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.module_tracker import ModuleTracker
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.allowlist import Allowlist
from ..core.numerics import Health, any_nonfinite, is_float, tensor_health
from ..core.tree import tensor_leaves
from . import probes
from .deadline import check_deadline

__all__ = ["born", "ModuleMonitor", "OpMonitor"]


def born(inputs: Optional[Health], output: Optional[Health]) -> bool:
    """The producer rule: NaN in the output with no NaN in the inputs, or ±Inf in the output
    with all inputs finite."""
    if output is None or output.finite:
        return False
    if inputs is None:
        return True
    if output.nan and not inputs.nan:
        return True
    return (output.posinf or output.neginf) > 0 and inputs.finite


class ModuleMonitor:
    """Forward health of every module, in execution order (completion order of forwards), and
    backward events: the cotangent at each module's output and each parameter's gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.fqn = {id(m): n for n, m in model.named_modules()}
        self.events: list[dict] = []
        self._stack: list[Optional[Health]] = []
        self._handles: list[Any] = []
        self.phase = "forward"
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        for name, p in model.named_parameters():
            if p.requires_grad:
                owner = name.rpartition(".")[0]
                self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook(name, owner)))

    def _pre(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._stack.append(tensor_health(tensor_leaves((args, kwargs))))

    def _post(self, mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        check_deadline()
        h_in = self._stack.pop() if self._stack else None
        h_out = tensor_health(tensor_leaves(out))
        name = self.fqn.get(id(mod), "?")
        self.events.append(
            {"phase": self.phase, "module": name, "class": type(mod).__name__, "inputs": h_in, "output": h_out, "born": born(h_in, h_out)}
        )
        for t in tensor_leaves(out):
            if t.requires_grad and is_float(t):
                t.register_hook(self._cot_hook(name, type(mod).__name__))

    def _cot_hook(self, name: str, cls: str) -> Callable:
        def hook(g: torch.Tensor) -> None:
            self.events.append({"phase": "backward", "kind": "output cotangent", "module": name, "class": cls, "output": tensor_health([g])})

        return hook

    def _param_hook(self, pname: str, owner: str) -> Callable:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self.events.append({"phase": "backward", "kind": "parameter gradient", "module": owner, "param": pname, "output": tensor_health([p.grad])})

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class OpMonitor(TorchDispatchMode):
    """Checks every aten op's floating outputs during replay. Records each *birth* (an op whose
    output holds a non-finite value its inputs did not explain, by the producer rule) with its
    phase, op name and innermost module FQN, plus a count of ops that propagated non-finite values.
    Technique: ``TorchDispatchMode`` sees functional ops and backward kernels alike, which module
    hooks miss; ``ModuleTracker`` supplies the module context in both passes."""

    def __init__(self, tracker: ModuleTracker, root_class: str, *, max_births: int = 32, allow: Optional[Allowlist] = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.root = root_class
        self.births: list[dict] = []
        self.allowed: list[dict] = []    # births matched by the allowlist (legitimate -Inf masks)
        self.propagated = 0
        self.max_births = max_births
        self.allow = allow if allow is not None else Allowlist()
        self.phase = "forward"
        self.index = 0
        self.micro_batch: Optional[int] = None  # which recorded batch / forward call is replaying

    def module(self) -> Optional[str]:
        """FQN of the innermost module running now; ``""`` for the root, ``None`` outside the model."""
        names = [p for p in self.tracker.parents if p != "Global"]
        if not names:
            return None
        inner = max(names, key=lambda n: n.count("."))
        head, _, rest = inner.partition(".")
        return rest if head == self.root else inner

    # ops whose output is uninitialised memory: never a birth, never checked
    _UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "empty_permuted"})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        check_deadline()
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in self._UNINITIALISED:
            return func(*args, **kwargs)
        # in-place and out= ops overwrite an input: take the inputs' health before the op runs
        mutating = func._schema.is_mutable if hasattr(func, "_schema") else False
        h_in_before = tensor_health(tensor_leaves((args, kwargs))) if mutating else None
        out = func(*args, **kwargs)
        self.index += 1
        outs = tensor_leaves(out)
        if not outs or not any_nonfinite(outs):
            return out
        h_in = h_in_before if mutating else tensor_health(tensor_leaves((args, kwargs)))
        h_out = tensor_health(outs)
        if born(h_in, h_out):
            self._record_birth(func, name, args, kwargs, outs, h_in, h_out, mutating)
        else:
            self.propagated += 1
        return out

    def _phase_now(self, module: Optional[str]) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if self.phase == "backward" or self.tracker.is_bw:
            return "backward"
        return "loss" if (self.phase == "loss_fn" and module is None) else "forward"

    def _record_birth(self, func: Any, name: str, args: tuple, kwargs: dict, outs: list, h_in: Optional[Health], h_out: Health, mutating: bool) -> None:
        """Describe one birth: where (phase, module, source line, autograd node and its forward
        source), what (health, dtype, shape, non-finite rows) and why (wider-dtype recomputation,
        zeros in the inputs). Allowed births (legitimate -Inf masks) are kept apart."""
        module = self.module()
        phase = self._phase_now(module)
        rule = self.allow.match(module, name, h_out)
        if rule is not None:
            if len(self.allowed) < self.max_births:
                self.allowed.append({"phase": phase, "op": name, "module": module, "op_index": self.index, "rule": str(rule), "output": h_out})
            return
        if len(self.births) >= self.max_births:
            return
        b: dict = {"phase": phase, "op": name, "aten": str(func), "module": module, "op_index": self.index, "inputs": h_in, "output": h_out,
                   "micro_batch": self.micro_batch}
        if phase == "backward":
            node, fwd_src = probes.current_node()
            b["node"] = node
            b["forward_op"] = probes.node_forward_op(node)
            b["source"] = fwd_src
        else:
            b["node"] = None
            b["source"] = probes.user_frame_now()
        b["wider"] = None if mutating else probes.wider_recompute(func, args, kwargs, outs)
        b["input_zeros"] = probes.zero_counts(tensor_leaves((args, kwargs)))
        b["rows"] = probes.nonfinite_rows(outs)
        self.births.append(b)

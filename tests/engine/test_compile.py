"""torch.compile: the Recorder adds no graph break in any of the four orders a user may write
(``Recorder(torch.compile(m))``, ``torch.compile`` after the Recorder, ``m.compile()`` before or
after it), records the original module's names, and the ``nanreplay replay`` command printed by
the exception replays a compiled model's failure."""

from __future__ import annotations

import contextlib
import logging
import random
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import models
from helpers import fail_within
from nanreplay import NonFiniteGradientError, Recorder, open_bundle

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

NANREPLAY_DIR = str(Path(__file__).resolve().parents[2] / "nanreplay")
ORDERS = ("compile-then-record", "record-then-compile", "method-compile-then-record", "record-then-method-compile")


class _GraphBreaks(logging.Handler):
    """Collects Dynamo's graph-break log records (``TORCH_LOGS=graph_breaks``): each names the
    user-code line where the graph broke and the traceback that led there."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Graph break" in msg:
            self.messages.append(msg)

    def files(self, msg: str) -> list[str]:
        """The source files a graph-break message names (its location and its traceback)."""
        return re.findall(r'File "([^"]+)"', msg) + re.findall(r"Graph break in user code at (\S+?):\d+", msg)

    def in_nanreplay(self) -> list[str]:
        return [m for m in self.messages if any(f.startswith(NANREPLAY_DIR) for f in self.files(m))]


@contextlib.contextmanager
def graph_breaks():
    """Count the graph breaks of the block: yields the handler; ``counters['graph_break']`` holds
    the totals. Dynamo's caches are reset first, so every case compiles from scratch."""
    dynamo.reset()
    counters.clear()
    handler = _GraphBreaks()
    torch._logging.set_logs(graph_breaks=True)
    # Dynamo's artifact loggers (``torch._dynamo.symbolic_convert.__graph_breaks``, ...) stop
    # propagating at ``torch._dynamo``'s own handler: listen on each one
    from torch._logging._internal import log_registry

    logs = [logging.getLogger(q) for q in sorted(log_registry.artifact_log_qnames) if q.endswith("__graph_breaks")]
    assert logs, "no graph_breaks artifact logger registered"
    for lg in logs:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in logs:
            lg.removeHandler(handler)
        torch._logging.set_logs()
        dynamo.reset()


def _attach(order: str, model: torch.nn.Module, opt, out_dir, backend: str = "eager", **opts):
    """(the callable the loop runs, the Recorder), attached in ``order``."""
    if order == "compile-then-record":
        run = torch.compile(model, backend=backend)
        return run, Recorder(run, opt, out_dir=out_dir, **opts)
    if order == "record-then-compile":
        rec = Recorder(model, opt, out_dir=out_dir, **opts)
        return torch.compile(model, backend=backend), rec
    if order == "method-compile-then-record":
        model.compile(backend=backend)
        return model, Recorder(model, opt, out_dir=out_dir, **opts)
    rec = Recorder(model, opt, out_dir=out_dir, **opts)
    model.compile(backend=backend)
    return model, rec


def _train(run, opt, batches) -> None:
    for x in batches:
        loss = run(x).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _clean_batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(5, 4, generator=g) for _ in range(n)]


def _bad_batch() -> torch.Tensor:
    return 100.0 * torch.ones(5, 4)


def test_graph_break_detector_sees_a_hook_that_breaks():
    """The detector works: a forward pre-hook reading Python's RNG state (what a naive recorder
    does) breaks the graph, and the break is located in the hook's file."""
    model = models.make_root_mlp()
    model.register_forward_pre_hook(lambda m, args: random.getstate() and None)
    with graph_breaks() as gb:
        _train(torch.compile(model, backend="eager"), torch.optim.SGD(model.parameters(), lr=0.0), _clean_batches(2))
    assert sum(counters["graph_break"].values()) >= 1
    assert any(__file__ in gb.files(m) for m in gb.messages)


def test_the_model_alone_compiles_without_graph_breaks():
    """The baseline the order tests compare against: no graph break without nanreplay."""
    model = models.make_root_mlp()
    with graph_breaks() as gb:
        _train(torch.compile(model, backend="eager"), torch.optim.SGD(model.parameters(), lr=0.0), _clean_batches(2))
    assert sum(counters["graph_break"].values()) == 0 and gb.messages == []


@pytest.mark.parametrize("order", ORDERS)
def test_recorder_adds_no_graph_break_and_records_plain_names(order, out_dir):
    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graph_breaks() as gb:
        run, rec = _attach(order, model, opt, out_dir, diagnose=False, embed_program=False)
        with rec:
            _train(run, opt, _clean_batches(3))
            # every step's forward was captured, with its cotangent (the tap moved without losing a call)
            assert [len(r.forwards) for r in rec.ring] == [1, 1, 1]
            assert all(r.forwards[0].cotangent is not None for r in rec.ring)
            if order == "record-then-compile":  # the tap found the compiled wrapper calling the model and moved there
                assert rec._tap.compiled_wrapper is run
            with pytest.raises(NonFiniteGradientError) as info:
                _train(run, opt, [_bad_batch()])
    assert gb.in_nanreplay() == [], "graph breaks in nanreplay's code:\n" + "\n\n".join(gb.in_nanreplay())
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    with open_bundle(info.value.bundle_path) as b:
        names = list(b.state().params)
        assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert not any("_orig_mod" in k for k in b.keys())
        assert b.failing_step == 3


def _source_line(fn, code: str) -> int:
    """The line number of the line of ``fn``'s source that holds ``code``."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if code in text)


def _printed_command(err: NonFiniteGradientError) -> list[str]:
    m = re.search(r"replay it with: (nanreplay replay .+?)(?:;|$)", str(err))
    assert m, str(err)
    return shlex.split(m.group(1))


def _replay_printed(err: NonFiniteGradientError, *extra: str):
    from click.testing import CliRunner

    from nanreplay.cli import main

    argv = _printed_command(err)
    assert argv[:2] == ["nanreplay", "replay"]
    return CliRunner().invoke(main, argv[1:] + list(extra), catch_exceptions=False)


@pytest.mark.parametrize("order", ["compile-then-record", "record-then-method-compile"])
def test_printed_replay_command_works_for_a_compiled_model(order, out_dir):
    import json

    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run, rec = _attach(order, model, opt, out_dir, loss_fn=models.root_mean_loss, model_factory=models.make_root_mlp)
    with rec:
        for x in _clean_batches(2) + [_bad_batch()]:
            rec.record((x,))
            loss = models.root_mean_loss(run, (x,))
            loss.backward()
            if not torch.isfinite(loss):
                with pytest.raises(NonFiniteGradientError) as info:
                    opt.step()
                break
            opt.step()
            opt.zero_grad()
    res = _replay_printed(info.value)
    assert res.exit_code == 0, res.output
    assert "origin:        head (RootHead), op sqrt" in res.output
    res = _replay_printed(info.value, "--json")
    diag = json.loads(res.output)
    assert diag["origin"]["module"] == "head" and diag["origin"]["op"] == "sqrt" and diag["phase"] == "forward"
    assert diag["reproduction"]["verdict"].startswith("reproduced")


def _inductor_works() -> bool:
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch build without inductor
        return False
    return shutil.which("g++") is not None or shutil.which("cc") is not None or shutil.which("clang") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_works(), reason="torch inductor or a C++ compiler is not available")
def test_inductor_backend_adds_no_graph_break(out_dir):
    """The default backend (inductor, C++ codegen on the CPU): one case, the usual order."""
    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graph_breaks() as gb:
        run, rec = _attach("compile-then-record", model, opt, out_dir, backend="inductor", diagnose=False, embed_program=False)
        with rec:
            _train(run, opt, _clean_batches(2))
            assert [len(r.forwards) for r in rec.ring] == [1, 1]
    assert gb.in_nanreplay() == [] and sum(counters["graph_break"].values()) == 0


# -- replay --compile ------------------------------------------------------------------------------

def _bundle(model, run, out_dir, batches, **opts) -> NonFiniteGradientError:
    """Train ``run`` (``model`` or a compiled wrapper of it) on ``batches`` under a Recorder with
    the ``root_mean_loss`` loss until the step that fails; its error."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return fail_within(run, opt, [(x,) for x in batches], models.root_mean_loss, out_dir, loss_fn=models.root_mean_loss, **opts)


def test_replay_compile_when_both_replays_are_nonfinite(out_dir):
    from nanreplay import replay

    model = models.make_root_mlp()
    err = _bundle(model, model, out_dir, _clean_batches(1) + [_bad_batch()], model_factory=models.make_root_mlp, diagnose=False)
    plain = replay(err.bundle_path, samples=False)
    assert plain["compile"] is None and "torch.compile" not in plain["summary"]
    diag = replay(err.bundle_path, samples=False, compile="aot_eager")
    c = diag["compile"]
    assert (c["backend"], c["eager"], c["compiled"], c["only_under_compile"]) == ("aot_eager", True, True, False)
    assert c["target"] == "model"  # the embedded program's model part is compiled, its loss stays eager, as in training
    assert c["eager_nonfinite"] == c["compiled_nonfinite"] == ["loss", "gradients"]
    assert c["compiled_kinds"] == "NaN" and c["compiled_reproduction"].startswith("reproduced") and c["error"] is None
    # the eager diagnosis is unchanged; the sentence adds what compile did
    assert diag["origin"]["module"] == "head" and diag["classification"] == plain["classification"]
    assert "; also non-finite under torch.compile (backend aot_eager);" in diag["summary"]


def test_replay_compile_names_a_nan_only_under_compile(out_dir):
    """Training ran compiled; the model's forward takes a NaN branch only while compiling. The
    eager replay is finite; --compile says the NaN is compiled-only, in the sentence, the cause
    and the text report, and exits 0 (the compiled replay reproduced the recording)."""
    from click.testing import CliRunner

    from nanreplay import replay
    from nanreplay.cli import main

    model = models.make_compiled_only_nan()
    run = torch.compile(model, backend="eager")
    err = _bundle(model, run, out_dir, _clean_batches(1), model_factory=models.make_compiled_only_nan, diagnose=False, embed_program=False)
    diag = replay(err.bundle_path, samples=False, compile="eager")
    c = diag["compile"]
    assert (c["eager"], c["compiled"], c["only_under_compile"]) == (False, True, True)
    assert c["compiled_reproduction"] == "reproduced exactly"
    assert diag["phase"] == "none" and diag["classification"]["cause"] == "compiler"
    # the first stage non-finite is Dynamo's own (backend eager: no AOTAutograd), and inside its
    # graph the birth is the sqrt of the branch taken only while tracing, every row of it
    assert (c["stage"], c["stage_backend"]) == ("graph capture", "eager")
    assert [(r["backend"], r["compiled"]) for r in c["backends"]] == [("eager", True), ("aot_eager", True)]
    line = _source_line(models.CompiledOnlyNaN.forward, "torch.sqrt(h - 100.0)")
    cul = c["culprit"]
    assert (cul["op"], cul["module"], cul["graph"], cul["source"]["line"], cul["source"]["code"]) == (
        "sqrt", "", "forward", line, "h = torch.sqrt(h - 100.0)")
    assert diag["samples"]["batch_level"] and diag["samples"]["method"] == "non-finite rows of the compiled op's output"
    assert diag["summary"].startswith(
        f"step 0: NaN only under torch.compile (backend eager), born in op sqrt at models.py:{line} in module (root module) (Dynamo's "
        "graph capture, forward graph), every sample: the step replayed eagerly is finite, replayed compiled its "
        "loss and gradients are not (the compiled replay against the recording: reproduced exactly); cause: compiler ("
    ), diag["summary"]
    assert diag["summary"].endswith("; not reproduced eagerly.")
    assert c["target"] == "model"
    res = CliRunner().invoke(main, ["replay", err.bundle_path, "--compile", "--compile-backend", "eager", "--no-samples"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert ("  torch.compile: eager finite; compiled (backend eager) NaN in loss and gradients: only under compile; "
            "compiled replay vs recording: reproduced exactly") in res.output
    # without --compile the bundle's compile state (the model ran compiled) makes the diagnosis
    # replay it compiled on its own: the same finding (exit 0)
    res = CliRunner().invoke(main, ["replay", err.bundle_path, "--no-samples"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "cause: compiler" in res.output


# -- the compile state in the bundle, and the compiled replay it triggers --------------------------

@pytest.mark.parametrize("order", ORDERS)
def test_the_bundle_records_the_compile_state(order, out_dir):
    """Whichever order the loop compiles in, the bundle says the model ran compiled, with which
    backend and which module ("" = the model itself)."""
    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run, rec = _attach(order, model, opt, out_dir, backend="aot_eager", diagnose=False, embed_program=False)
    with rec:
        _train(run, opt, _clean_batches(2))
        with pytest.raises(NonFiniteGradientError) as info:
            _train(run, opt, [_bad_batch()])
    with open_bundle(info.value.bundle_path) as b:
        assert b.meta["compile"] == {"compiled": True, "backend": "aot_eager", "mode": None, "modules": [""], "options": None, "dynamic": None,
                                     "fullgraph": False}


def test_the_bundle_records_an_eager_model_and_a_compiled_submodule(out_dir):
    model = models.make_root_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, opt, out_dir=out_dir, diagnose=False, embed_program=False) as rec:
        _train(model, opt, _clean_batches(1))
        assert rec._dump.compile_state() == {"compiled": False, "backend": None, "mode": None, "modules": [], "options": None, "dynamic": None,
                                             "fullgraph": None}
        model.fc2.compile(backend="eager")
        with pytest.raises(NonFiniteGradientError) as info:
            _train(model, opt, [_bad_batch()])
    with open_bundle(info.value.bundle_path) as b:
        assert b.meta["compile"] == {"compiled": True, "backend": "eager", "mode": None, "modules": ["fc2"], "options": None, "dynamic": None,
                                     "fullgraph": False}


def test_a_bundle_with_a_malformed_compile_state_is_refused(sqrt_bundle, tmp_path):
    from nanreplay.errors import BundleFormatError
    from nanreplay.format.bundle import write_bundle

    with open_bundle(sqrt_bundle) as b:
        content = b.content()
    content.extra_meta["compile"] = {"compiled": "yes", "backend": "inductor", "mode": None, "modules": []}
    path = write_bundle(tmp_path / "bad.h5", content)
    with pytest.raises(BundleFormatError, match=r"expected true, false at meta\.compile\.compiled, found 'yes'"):
        open_bundle(path)


def test_an_unreproduced_eager_replay_replays_compiled_as_recorded(out_dir):
    """The recording ran compiled; the eager replay is finite. Without being asked (no
    --compile), the in-process diagnosis and `nanreplay replay` replay the step compiled as the
    bundle says, and name the compiler, with the compile state in the evidence."""
    from click.testing import CliRunner

    from nanreplay import replay
    from nanreplay.cli import main

    model = models.make_compiled_only_nan()
    run = torch.compile(model, backend="eager")
    err = _bundle(model, run, out_dir, _clean_batches(1), model_factory=models.make_compiled_only_nan, embed_program=False)
    for diag in (err.diagnosis, replay(err.bundle_path, samples=False)):
        c = diag["compile"]
        assert (c["automatic"], c["backend"], c["eager"], c["compiled"], c["only_under_compile"]) == (True, "eager", False, True, True)
        assert diag["classification"]["cause"] == "compiler"
        assert ("the model ran under torch.compile (backend eager; compiled: the model): the eager replay did not reproduce the step, "
                "so it was replayed compiled the same way") in diag["classification"]["evidence"]
        assert "repeats" not in diag["reproduction"]  # no hardware-fault checks once the compiler is shown
    res = CliRunner().invoke(main, ["replay", err.bundle_path, "--no-samples"], catch_exceptions=False)
    assert res.exit_code == 0, res.output  # the compiled replay reproduced the recording


def _identity_backend(gm, example_inputs):
    return gm.forward


def test_a_recorded_backend_outside_the_allowlist_is_named_not_run(out_dir):
    """A bundle is data: a backend it names that is not torch's own (here a callable's import
    path) is never looked up. The evidence says so, and the verdict is not 'transient' since the
    compiled check did not run."""
    from nanreplay import replay

    model = models.make_compiled_only_nan()
    run = torch.compile(model, backend=_identity_backend)
    err = _bundle(model, run, out_dir, _clean_batches(1), model_factory=models.make_compiled_only_nan, diagnose=False, embed_program=False)
    with open_bundle(err.bundle_path) as b:
        name = b.meta["compile"]["backend"]  # the callable's import path where it has one, else its name
        assert b.meta["compile"]["compiled"] and name.endswith("_identity_backend")
    diag = replay(err.bundle_path, samples=False)
    assert diag["compile"] is None
    cls = diag["classification"]
    assert cls["cause"] == "unknown", cls
    assert any(f"the recording compiled with backend {name!r}, not one a bundle may name" in e for e in cls["evidence"])
    assert any("no compiled replay of the step ran" in e for e in cls["evidence"])


class _CompiledInner(torch.nn.Module):
    """Only its submodule ``inner`` is compiled (``model.inner.compile()``), as in training."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)
        self.inner = models.make_compiled_only_nan()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def test_a_compiled_submodule_is_replayed_compiled_alone(out_dir):
    """The recording compiled one submodule: the in-process diagnosis replays the step with that
    submodule compiled (not the whole model), the rest eager, and finds the compiler."""
    torch.manual_seed(0)
    model = _CompiledInner()
    model.inner.compile(backend="eager")
    err = _bundle(model, model, out_dir, _clean_batches(1), embed_program=False)
    with open_bundle(err.bundle_path) as b:
        assert b.meta["compile"] == {"compiled": True, "backend": "eager", "mode": None, "modules": ["inner"], "options": None,
                                     "dynamic": None, "fullgraph": False}
    c = err.diagnosis["compile"]
    assert (c["automatic"], c["target"], c["eager"], c["only_under_compile"]) == (True, "modules inner", False, True)
    assert err.diagnosis["classification"]["cause"] == "compiler"
    assert model.inner.__dict__["_compiled_call_impl"] is not None  # the user's compiled call is back in place


# -- what the compiled replays compare, and where inside the compiled region ----------------------

def _rows_inductor_makes_nan(model, run, n: int = 8) -> torch.Tensor:
    """A [64] row (near an offset, tiny spread) whose one-pass variance only the compiled model
    (the training graph, a batch of ``n``) makes NaN on this machine: the CPU's vector width
    decides the order of inductor's partial sums, so the row is found here, not hard-coded."""
    for seed in range(256):
        g = torch.Generator().manual_seed(seed)
        offset = 1 + 9 * torch.rand(n, 1, generator=g)
        cand = offset + 1e-4 * offset * torch.randn(n, 64, generator=g)
        bad_compiled = ~torch.isfinite(run(cand)).all(-1)
        with torch.no_grad():
            bad_eager = ~torch.isfinite(model(cand)).all(-1)
        hit = (bad_compiled & ~bad_eager).nonzero().flatten()
        if len(hit):
            return cand[int(hit[0])].clone()
    pytest.skip("no row rounds differently enough in inductor's kernel on this machine")


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_works(), reason="torch inductor or a C++ compiler is not available")
def test_an_inductor_only_nan_is_named_by_plain_replay(out_dir):
    """Training compiled the model with inductor; a one-pass variance rounds below zero in
    inductor's kernel only, for sample 5. Plain `nanreplay replay` (out of process, from the
    program embedded with its loss: the model part compiled, the loss eager, as in training)
    says what the in-process diagnosis says: cause compiler, stage code generation, the aten op
    and source line inside the compiled region, sample 5, exit 0. --compile-backend adds a
    column; the recorded backend stays the main one."""
    import json

    from click.testing import CliRunner

    from nanreplay.cli import main

    model = models.make_one_pass_norm()
    run = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    clean = 1 + torch.randn(8, 64, generator=g)
    bad = clean.clone()
    bad[5] = _rows_inductor_makes_nan(model, run)
    err = _bundle(model, run, out_dir, [clean, bad], model_factory=models.make_one_pass_norm)
    line = _source_line(models.OnePassNorm.forward, "torch.rsqrt(")

    def facts(diag: dict) -> tuple:
        c = diag["compile"]
        cul = c["culprit"]
        return (diag["classification"]["cause"], c["stage"], c["backend"], c["target"], cul["op"], cul["module"],
                cul["source"]["line"], cul["graph"], diag["samples"]["indices"])

    want = ("compiler", "code generation", "inductor", "model", "rsqrt", "norm", line, "forward", [5])
    assert facts(err.diagnosis) == want, err.diagnosis["summary"]
    res = CliRunner().invoke(main, ["replay", err.bundle_path, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output  # reproduced as compiled
    diag = json.loads(res.output)
    assert facts(diag) == want, diag["summary"]
    c = diag["compile"]
    assert c["automatic"] and c["replayed_as_recorded"] and c["compiled_reproduction"] == "reproduced exactly"
    # the columns: aot_eager (Dynamo + AOTAutograd) and the graphs inductor receives run with eager
    # kernels are finite, inductor's kernels are not
    assert [(r["backend"], r["role"], r["compiled"]) for r in c["backends"]] == [
        ("aot_eager", "reference", False), ("aot_eager_decomp_partition", "capture", False), ("inductor", "main", True)]
    op = c["culprit"]["operands"][0]  # rsqrt's operand, var + eps: negative compiled, not eagerly
    assert float(op["compiled"]) < 0 <= float(op["eager"])
    assert f"born in op rsqrt at models.py:{line} in module norm (inductor's kernels (code generation), forward graph), samples [5]" \
        in diag["summary"]
    assert "hardware" not in json.dumps(diag["classification"])

    res = CliRunner().invoke(main, ["replay", err.bundle_path, "--compile-backend", "eager"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert ("  compiler:      by backend: eager finite, aot_eager finite, aot_eager_decomp_partition finite, inductor NaN: code generation"
            in res.output)
    assert f"  compiled op:   rsqrt at models.py:{line} in module norm" in res.output and "; samples [5]" in res.output


def test_the_bisection_names_the_first_node_a_compiler_gets_wrong():
    """The node bisection on its own, with a stand-in compiler that computes one node of the
    graph wrongly (rsqrt made NaN where its operand is large, as a miscompiled kernel would), on
    a step of two micro-batches of which only the second has such a row (row 3): it names that
    node, its source line and module, the call and the row, and its operand's compiled and eager
    values; a correct stand-in gives no culprit; under a time limit it stops before a
    compilation that would run past it."""
    import time

    from nanreplay.engine.compiled_nodes import GraphCapture, OutOfTime, bisect_kernels
    from nanreplay.engine.deadline import deadline

    model = models.make_one_pass_norm()
    cap = GraphCapture()
    model.forward = torch.compile(model.forward, backend=cap.backend(decompose=True))
    g = torch.Generator().manual_seed(0)
    x0, x1 = 1 + torch.randn(8, 64, generator=g), 1 + torch.randn(8, 64, generator=g)
    x1[3] *= 100  # its variance is ~1e4, the others' ~1
    for x in (x0, x1):  # two micro-batches: each graph is called twice
        model(x).sum().backward()
    assert [(g.kind, len(g.calls)) for g in cap.graphs] == [("forward", 2), ("backward", 2)]

    class Miscompiled(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and str(n.target) == "aten.rsqrt.default":
                out = torch.where(self.env[n.args[0]] > 100, float("nan"), out)
            return out

    compiled = []

    def wrong(gm, args):
        compiled.append(len(gm.graph.nodes))
        return lambda *a: Miscompiled(gm).run(*a)

    cul, n = bisect_kernels(cap.graphs, wrong, batch=8)
    line = _source_line(models.OnePassNorm.forward, "torch.rsqrt(")
    assert (cul["op"], cul["graph"], cul["call"], cul["calls"], cul["module"], cul["source"]["line"], cul["samples"]["indices"]) == (
        "rsqrt", "forward", 1, 2, "norm", line, [3])
    assert cul["compiled_value"] == "nan" and isinstance(cul["eager_value"], float)
    assert [o["op"] for o in cul["operands"]] == ["add"] and cul["operands"][0]["compiled"] == cul["operands"][0]["eager"] > 100
    assert n == len(compiled) and n <= 1 + len([m for m in cap.graphs[0].gm.graph.nodes if m.op == "call_function"]).bit_length()
    assert bisect_kernels(cap.graphs, lambda gm, args: gm, batch=8) == (None, 2)  # a correct compiler: no node to blame

    def slow(gm, args):
        time.sleep(0.5)
        return wrong(gm, args)

    with deadline(1.0), pytest.raises(OutOfTime, match="with the culprit among nodes"):
        bisect_kernels(cap.graphs, slow, batch=8)


def test_a_finite_compiled_replay_of_a_compiled_recording_is_not_called_hardware(out_dir):
    """The recording ran compiled and its gradients hold a NaN the step does not produce (written
    after backward). The eager and the compiled replays, as recorded, are finite: the verdict is
    not a device fault; the compile entry says it replayed as recorded and what may still differ."""
    from nanreplay import replay

    model = models.make_root_mlp()
    run = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(run, opt, loss_fn=models.root_mean_loss, model_factory=models.make_root_mlp, out_dir=out_dir, diagnose=False,
                  embed_program=False) as rec:
        x = _clean_batches(1)[0]
        rec.record((x,))
        loss = models.root_mean_loss(run, (x,))
        rec.log_loss(loss)
        loss.backward()
        model.fc1.weight.grad[0, 0] = float("nan")  # not made by the step: no replay can reproduce it
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
    diag = replay(info.value.bundle_path, samples=False)
    c = diag["compile"]
    assert (c["automatic"], c["eager"], c["compiled"], c["replayed_as_recorded"]) == (True, False, False, True)
    assert any("replayed compiled as recorded is finite" in d for d in c["differs"])
    assert diag["classification"]["cause"] != "transient"
    assert "suspected hardware" not in diag["summary"] and "ECC" not in json_text(diag["classification"])
    assert any("what differs from the recording" in e for e in diag["classification"]["evidence"])


def json_text(obj) -> str:
    import json

    return json.dumps(obj, default=str)


def test_the_compile_state_keeps_options_dynamic_and_fullgraph_and_a_replay_sets_only_safe_options(sqrt_bundle, tmp_path):
    from nanreplay.capture.compiled import compile_state
    from nanreplay.errors import BundleFormatError
    from nanreplay.engine.compiled import recorded_compile
    from nanreplay.format.bundle import write_bundle

    m = models.make_root_mlp()
    st = compile_state(torch.compile(m, options={"epilogue_fusion": False, "cpp.simdlen": 8}, dynamic=False, fullgraph=True), m)
    assert st == {"compiled": True, "backend": "inductor", "mode": None, "modules": [""], "options": {"epilogue_fusion": False, "cpp.simdlen": 8},
                  "dynamic": False, "fullgraph": True}
    assert compile_state(torch.compile(m, mode="max-autotune-no-cudagraphs"), m)["options"] == {}  # a named mode says it all
    opts, _ = recorded_compile(dict(st, options={"epilogue_fusion": False, "trace.enabled": True, "cpp.cxx": "/tmp/evil", "max_fusion_size": "64",
                                                 "no_such_option": 1}))
    assert opts["options"] == {"epilogue_fusion": False}
    assert sorted(opts["skipped_options"]) == ["cpp.cxx", "max_fusion_size", "no_such_option", "trace.enabled"]
    assert (opts["dynamic"], opts["fullgraph"]) == (False, True)
    # an older bundle's state (no options, dynamic, fullgraph) still reads; a malformed option does not
    assert recorded_compile({"compiled": True, "backend": "inductor", "mode": None, "modules": [""]})[0]["options"] is None
    with open_bundle(sqrt_bundle) as b:
        content = b.content()
    content.extra_meta["compile"] = dict(st, options={"epilogue_fusion": [1, 2]})
    path = write_bundle(tmp_path / "bad.h5", content)
    with pytest.raises(BundleFormatError, match=r"expected a boolean, a number or a string at meta\.compile\.options\['epilogue_fusion'\]"):
        open_bundle(path)

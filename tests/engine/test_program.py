"""The embedded program (nanreplay.engine.program): export at dump time, load without the user's
code, and replay forward + loss + backward bit-identically to the eager model, by FQN."""

from __future__ import annotations

import copy
import io
import json
import pickle
import time
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from nanreplay import NonFiniteGradientError, Recorder, open_bundle, replay, write_bundle
from nanreplay.engine.program import (
    PROGRAM_META_KEY,
    ProgramModel,
    build_from_program,
    export_program,
    load_program,
    program_content,
    program_loss,
)
from nanreplay.errors import ReplayError


# -- models -------------------------------------------------------------------------------------

class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.drop(F.gelu(self.fc(x))))


class NestedDropout(nn.Module):
    """Nested submodules, dropout (RNG draws), BatchNorm (buffers written in the forward), a
    frozen parameter and a criterion submodule the loss function calls."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"a": Inner(), "b": Inner()})
        self.head = nn.Linear(8, 3)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder["b"](self.encoder["a"](self.frozen(x)))
        return self.head(F.dropout(x, 0.2, self.training))


def criterion_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return model.criterion(model(x), y)


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal | pad[:, None, None, :], float("-inf"))
        y = self.drop(scores.softmax(-1)) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TinyTransformer(nn.Module):
    """Embedding, a pre-norm block with masked attention, tied output head: a Transformer-style block."""

    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.ModuleDict({"ln": nn.LayerNorm(d), "attn": Attention(d)}) for _ in range(2)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> dict:
        x = self.tok(ids)
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln"](x), pad)
        return {"logits": self.head(x), "hidden": x}


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(batch["ids"], pad=batch["pad"])["logits"]
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), batch["ids"][:, 1:].reshape(-1))


def lm_batch(b: int = 3, t: int = 6) -> dict:
    g = torch.Generator().manual_seed(5)
    pad = torch.zeros(b, t, dtype=torch.bool)
    pad[0, -2:] = True
    return {"ids": torch.randint(0, 20, (b, t), generator=g), "pad": pad}


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # Python control flow on a tensor value: export cannot trace it
            return y * 2
        return y


# -- helpers ------------------------------------------------------------------------------------

def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _roundtrip(cap) -> ProgramModel:
    """Load the program through JSON text, as a bundle would (the record must survive strict JSON)."""
    meta = json.loads(json.dumps(cap.meta, allow_nan=False))
    return load_program(meta, cap.tensors.__getitem__)


def _eager_and_program(model, loss_fn, batch, seed=11):
    """(eager loss, eager grads, program loss, program grads, program) from the same RNG state."""
    eager = copy.deepcopy(model)
    cap = export_program(model, loss_fn=loss_fn, batch=batch)
    assert cap.ok, cap.error
    pm = _roundtrip(cap)
    torch.manual_seed(seed)
    l1 = loss_fn(eager, batch)
    l1.backward()
    torch.manual_seed(seed)
    l2 = program_loss(pm, batch)
    l2.backward()
    return l1, _grads(eager), l2, _grads(pm), pm, eager


# -- round trips ----------------------------------------------------------------------------------

def test_a_serializer_that_cannot_skip_its_pickles_still_gives_the_program(monkeypatch):
    """torch 2.11's ``serialize`` has no ``serialize_state_dict=`` (seen on a GPU machine: every
    bundle there had no program, and replay in another process needed the model factory): the
    export then takes the JSON part of the full artifact and drops the pickled parts."""
    import torch._export.serde.serialize as ser

    real, calls = ser.serialize, []

    def serialize_without_options(exported_program, opset_version=None, pickle_protocol=2):
        calls.append(pickle_protocol)
        return real(exported_program, opset_version, pickle_protocol)

    model, x = models.MLP(), torch.randn(5, 8)
    expected = export_program(model, (x,), verify=False)
    monkeypatch.setattr(ser, "serialize", serialize_without_options)
    cap = export_program(model, (x,), verify=False)
    assert calls and cap.ok, cap.error
    assert cap.meta["program"] == expected.meta["program"]
    assert torch.equal(_roundtrip(cap)(x), model(x))



def test_mlp_forward_program_is_bit_identical():
    model = models.MLP()
    x = torch.randn(5, 8)
    cap = export_program(model, (x,))
    assert cap.ok, cap.error
    assert cap.meta["kind"] == "forward" and cap.meta["torch"] == torch.__version__ and cap.meta["export_seconds"] > 0
    pm = _roundtrip(cap)
    out1, out2 = model(x), pm(x)
    assert torch.equal(out1, out2)
    w = torch.randn_like(out1)
    (out1 * w).sum().backward()
    (out2 * w).sum().backward()
    g1, g2 = _grads(model), _grads(pm)
    assert list(g1) == list(g2) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in pm.parameters())


def test_nested_dropout_batchnorm_and_criterion_loss_are_bit_identical():
    model = NestedDropout().train()
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    l1, g1, l2, g2, pm, eager = _eager_and_program(model, criterion_loss, batch)
    assert torch.equal(l1, l2)  # same dropout masks: the RNG draws are the eager ones
    assert list(g1) == list(g2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    # BatchNorm's running statistics were updated in place, as in eager training mode
    for (n1, b1), (n2, b2) in zip(eager.named_buffers(), pm.named_buffers()):
        assert n1 == n2 and torch.equal(b1, b2), n1
    assert pm.get_submodule("encoder.a.bn").num_batches_tracked.item() == 1
    # FQNs, classes and requires_grad as in the original
    own = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    assert own <= {n for n, _ in pm.named_modules()}
    classes = dict((n, type(m).__name__) for n, m in pm.named_modules())
    assert classes["encoder.a.fc"] == "Linear" and classes["encoder.b.bn"] == "BatchNorm1d" and classes[""] == "NestedDropout"
    assert not pm.frozen.weight.requires_grad and pm.head.weight.requires_grad
    # a different seed gives different masks: the test above is not vacuous
    torch.manual_seed(12)
    assert not torch.equal(program_loss(pm, batch), l2)


def test_transformer_block_with_masks_and_tied_weights():
    model = TinyTransformer().train()
    batch = lm_batch()
    l1, g1, l2, g2, pm, _ = _eager_and_program(model, lm_loss, batch)
    assert torch.equal(l1, l2)
    assert list(g1) == list(g2) and "head.weight" not in g1  # tied: one parameter, as named_parameters says
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    assert pm.head.weight is pm.tok.weight
    # stored by the program itself (no bundle to share with): the tied weight once, tied again on load
    cap = export_program(model, loss_fn=lm_loss, batch=lm_batch(), verify=False)
    assert [k for k in cap.tensors if k.endswith(("tok.weight", "head.weight"))] == ["program/model.tok.weight"]
    own = _roundtrip(cap)
    assert own.head.weight is own.tok.weight and [n for n, _ in own.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_forward_program_rebuilds_the_output_tree_and_replays_the_cotangent():
    model = TinyTransformer().train()
    batch = lm_batch()
    cap = export_program(model, (batch["ids"],), {"pad": batch["pad"]})
    assert cap.ok, cap.error
    pm = _roundtrip(cap)
    torch.manual_seed(3)
    o1 = model(batch["ids"], pad=batch["pad"])
    torch.manual_seed(3)
    o2 = pm(batch["ids"], pad=batch["pad"])
    assert set(o2) == {"logits", "hidden"} and torch.equal(o1["logits"], o2["logits"])
    cot = [torch.randn_like(o1["logits"]), torch.randn_like(o1["hidden"])]
    torch.autograd.backward([o1["logits"], o1["hidden"]], cot)
    torch.autograd.backward([o2["logits"], o2["hidden"]], cot)
    for n, g in _grads(model).items():
        assert torch.equal(g, _grads(pm)[n]), n
    with pytest.raises(ReplayError, match="expects bool"):
        pm(batch["ids"], pad=batch["pad"].float())


def test_exports_from_two_threads_run_one_at_a_time(monkeypatch):
    """torch.export sets process-wide state while it runs: two training threads dumping at once
    export one after the other, both succeed, and the 'inside an export' flag is off after."""
    import threading

    inside, most = [0], [0]
    real = torch.export.export

    def counting(*a, **k):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.2)  # hold the export open so an unserialised second one would overlap
            return real(*a, **k)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(torch.export, "export", counting)
    caps, start = [], threading.Barrier(2)

    def run() -> None:
        start.wait(10)
        caps.append(export_program(models.MLP(), (torch.randn(5, 8),), verify=False))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(caps) == 2 and all(c.ok for c in caps), [c.error for c in caps]
    assert most[0] == 1
    assert not torch.compiler.is_exporting()


def test_dynamic_shapes_let_another_micro_batch_length_run():
    model = TinyTransformer().train()
    cap = export_program(model, loss_fn=lm_loss, batch=lm_batch(3, 6), dynamic=True)
    assert cap.ok and cap.meta["dynamic"]
    pm = _roundtrip(cap)
    other = lm_batch(4, 9)
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    l1 = lm_loss(eager, other)
    torch.manual_seed(1)
    assert torch.equal(l1, program_loss(pm, other))
    fixed = _roundtrip(export_program(model, loss_fn=lm_loss, batch=lm_batch(3, 6)))
    assert not fixed.program_meta["dynamic"]
    with pytest.raises(ReplayError, match=r"expects int64 \[3, 6\]"):
        program_loss(fixed, other)


def test_export_failure_is_reported_not_raised():
    cap = export_program(DataDependent(), (torch.randn(2, 4),))
    assert not cap.ok and cap.meta is None and cap.tensors == {}
    assert "data" in cap.error.lower() or "guard" in cap.error.lower(), cap.error
    cap = export_program(models.MLP(), loss_fn=models.mse_loss)  # no batch
    assert not cap.ok and "batch" in cap.error


def test_export_leaves_the_live_model_untouched():
    model = NestedDropout().train()
    model.encoder["a"].eval()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    criterion_loss(model, (x, y)).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = _grads(model)
    modes = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    cap = export_program(model, loss_fn=criterion_loss, batch=(x, y))
    assert cap.ok, cap.error
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], g) for n, g in _grads(model).items())
    assert modes == {n: m.training for n, m in model.named_modules()}
    # the eval-mode submodule was exported with eval behaviour (no dropout, running stats used)
    pm = _roundtrip(cap)
    torch.manual_seed(0)
    l1 = criterion_loss(copy.deepcopy(model), (x, y))
    torch.manual_seed(0)
    assert torch.equal(l1, program_loss(pm, (x, y)))


def test_serialized_program_holds_no_pickle(monkeypatch):
    """No torch.save / pickle on the way out or in; the record is plain JSON and tensors."""

    def refuse(*a, **k):
        raise AssertionError("pickle or torch.save/torch.load was called")

    for mod, name in [(torch, "save"), (torch, "load"), (pickle, "dumps"), (pickle, "dump"), (pickle, "loads"), (pickle, "load")]:
        monkeypatch.setattr(mod, name, refuse)
    model = NestedDropout().train()
    batch = (torch.randn(8, 8), torch.randint(0, 3, (8,)))
    cap = export_program(model, loss_fn=criterion_loss, batch=batch)
    assert cap.ok, cap.error
    data = json.dumps(cap.meta, allow_nan=False).encode()
    assert b"\x80" not in data  # no pickle protocol header (JSON is ASCII)
    assert not zipfile.is_zipfile(io.BytesIO(data)) and b"PK\x03\x04" not in data  # no torch.save zip
    assert all(type(t) is torch.Tensor for t in cap.tensors.values())
    assert isinstance(cap.meta["program"], dict) and "graph_module" in cap.meta["program"]
    pm = _roundtrip(cap)
    assert torch.isfinite(program_loss(pm, batch))


def test_a_program_naming_anything_but_torch_ops_is_refused():
    cap = export_program(models.MLP(), (torch.randn(2, 8),))
    text = json.dumps(cap.meta)
    assert "torch.ops.aten.linear.default" in text
    for evil in ["builtins.eval", "torch.os.system", "torch.ops.aten.__class__.__subclasses__"]:
        meta = json.loads(text.replace("torch.ops.aten.linear.default", evil, 1))
        with pytest.raises(ReplayError, match="allowlist"):
            load_program(meta, cap.tensors.__getitem__)


def test_bench_models_round_trip():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import models as _  # noqa: F401  (tests/models is imported already; load bench/models by path)
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_models", Path(__file__).resolve().parents[2] / "bench" / "models.py")
        bm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bm)
    finally:
        sys.path.pop(0)
    for name in ("mlp", "cnn", "gpt"):
        factory, make_batch, lossf = bm.spec(name, 0.125)
        torch.manual_seed(0)
        model = factory().train()
        x, y = make_batch(torch.Generator().manual_seed(1), torch.device("cpu"))

        def loss_fn(m, b, lossf=lossf):
            return lossf(m(b[0]), b[1])

        l1, g1, l2, g2, _, _ = _eager_and_program(model, loss_fn, (x, y))
        assert torch.equal(l1, l2), name
        assert list(g1) == list(g2), name
        for n in g1:
            assert torch.equal(g1[n], g2[n]), (name, n)


# -- the two ends for the recorder and replay -----------------------------------------------------

def _failing_bundle(out_dir, **opts):
    """A real Recorder bundle of NestedDropout's step where a NaN input row poisons the step."""
    torch.manual_seed(0)
    model = NestedDropout().train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    bad = x.clone()
    bad[3, 2] = float("nan")
    with Recorder(model, opt, loss_fn=criterion_loss, out_dir=out_dir, diagnose=False, **opts) as rec:
        for step, xb in enumerate([x, bad]):
            rec.record((xb, y))
            loss = criterion_loss(model, (xb, y))
            loss.backward()
            if step == 1:
                with pytest.raises(NonFiniteGradientError) as info:
                    opt.step()
            else:
                opt.step()
                opt.zero_grad()
    return model, info.value.bundle_path


def _embed(model, path, loss_fn):
    """What the integrated dump will do: add the program to the bundle (pre-step weights are still in the model)."""
    with open_bundle(path) as b:
        content = b.content()
    meta, tensors = program_content(model, content.steps[-1], loss_fn)
    content.extra_meta[PROGRAM_META_KEY] = meta
    content.extra_tensors.update(tensors)
    return write_bundle(path, content)


def test_program_in_a_bundle_replays_like_the_factory(out_dir):
    model, path = _failing_bundle(out_dir)
    _embed(model, path, criterion_loss)
    with open_bundle(path) as b:
        meta = b.meta[PROGRAM_META_KEY]
        assert meta["kind"] == "loss"
        # weights are shared with state/params: the program stores no second copy
        assert all(e["key"].startswith(("state/params/", "state/buffers/")) for e in meta["state"].values())
        assert not [k for k in b.keys() if k.startswith("program/")]
        pm, loss_fn = build_from_program(b)
        assert loss_fn is program_loss
        for n, p in pm.named_parameters():
            assert torch.equal(p.detach(), b.state().params[n]), n
        from_program = replay(b, model=pm, loss_fn=loss_fn)
        from_factory = replay(b, model=NestedDropout(), loss_fn=criterion_loss)
    assert from_program["mode"] == from_factory["mode"] == "loss_fn"
    assert from_program["reproduction"]["verdict"] == "reproduced exactly"
    for key in ("phase", "summary"):
        assert from_program[key] == from_factory[key], key
    assert from_program["origin"]["module"] == from_factory["origin"]["module"]
    assert from_program["origin"].get("op") == from_factory["origin"].get("op")


def test_forward_program_when_the_loss_does_not_export(out_dir):
    model, path = _failing_bundle(out_dir)

    def untraceable(m, batch):
        loss = criterion_loss(m, batch)
        return loss * 2 if loss > 0 else loss  # data-dependent: the loss export fails, the forward one does not

    _embed(model, path, untraceable)
    with open_bundle(path) as b:
        meta = b.meta[PROGRAM_META_KEY]
        assert meta["kind"] == "forward" and "forward+loss" in meta["loss_error"]
        pm, loss_fn = build_from_program(b)
        assert loss_fn is None
        diag = replay(b, model=pm, use_loss_fn=False)
    assert diag["mode"] == "cotangent" and diag["reproduction"]["verdict"] == "reproduced exactly"


def test_bundle_without_program_says_why(out_dir):
    model, path = _failing_bundle(out_dir)
    with open_bundle(path) as b:
        content = b.content()
    content.steps[-1].forwards.clear()
    meta, tensors = program_content(DataDependent(), content.steps[-1], None)
    assert meta["kind"] is None and "no forward call" in meta["error"] and tensors == {}
    content.extra_meta[PROGRAM_META_KEY] = meta
    write_bundle(path, content)
    with open_bundle(path) as b, pytest.raises(ReplayError, match="export failed when recording"):
        build_from_program(b)


def test_extra_tensors_round_trip_and_may_not_shadow_the_layout(out_dir):
    model, path = _failing_bundle(out_dir)
    with open_bundle(path) as b:
        content = b.content()
    content.extra_tensors["program/x"] = torch.arange(3)
    write_bundle(path, content)
    with open_bundle(path) as b:
        assert b.meta["extra_tensors"] == ["program/x"]
        again = b.content()
    assert torch.equal(again.extra_tensors["program/x"], torch.arange(3)) and "extra_tensors" not in again.extra_meta
    again.extra_tensors["grads/head.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="collide"):
        write_bundle(path, again)


def test_transformers_gpt2_from_a_config_round_trips():
    """A Hugging Face GPT-2 (tiny, random, from a config): its ModelOutput holds a DynamicCache,
    which is no tensor and no pytree type; the program keeps the tensors and rebuilds the output
    as a stand-in with the same fields."""
    transformers = pytest.importorskip("transformers")
    from nanreplay.integrations.transformers import hf_loss

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    batch = {"inputs": {"input_ids": ids, "attention_mask": mask, "labels": ids}, "divide_by": 2}
    l1, g1, l2, g2, pm, _ = _eager_and_program(model, hf_loss, batch)
    assert torch.equal(l1, l2) and list(g1) == list(g2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
    assert pm.lm_head.weight is pm.transformer.wte.weight  # tied, as in GPT-2
    assert type(pm.get_submodule("transformer.h.1.attn")).__name__ == "GPT2Attention"
    # forward kind: the output comes back as a stand-in of CausalLMOutputWithCrossAttentions
    cap = export_program(model, (), dict(batch["inputs"]))
    assert cap.ok, cap.error
    fwd = _roundtrip(cap)
    torch.manual_seed(2)
    o1 = model(**batch["inputs"])
    torch.manual_seed(2)
    o2 = fwd(**batch["inputs"])
    assert type(o2).__name__ == type(o1).__name__ and torch.equal(o1.logits, o2.logits)
    assert torch.equal(o1.loss, o2["loss"]) and torch.equal(o1.loss, o2[0])
    # every field compared by what nanreplay does, not by transformers' field names (which change:
    # past_key_values became cache in transformers 5): tensors equal, anything else (the cache
    # object) kept as its recorded repr
    for key, value in o1.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(o2, key)), key
        else:
            assert isinstance(getattr(o2, key), str), key


def test_a_symbolic_shape_that_is_python_code_is_refused():
    """torch's deserializer parses shape expressions with sympy.sympify (eval): only arithmetic on
    shape symbols may reach it."""
    model = TinyTransformer().train()
    cap = export_program(model, loss_fn=lm_loss, batch=lm_batch(3, 6), dynamic=True, verify=False)
    assert cap.ok and cap.meta["dynamic"], cap.error
    text = json.dumps(cap.meta)
    exprs = set()

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("expr_str"), str):
                exprs.add(x["expr_str"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(cap.meta["program"])
    assert exprs, "a dynamic program carries symbolic shapes"
    load_program(json.loads(text), cap.tensors.__getitem__)  # the genuine ones pass
    sym = sorted(exprs, key=len)[0]
    evil = "__import__('os').system('touch /tmp/nanreplay-pwned')"
    meta = json.loads(text.replace(json.dumps(sym), json.dumps(evil), 1))
    with pytest.raises(ReplayError, match="symbolic size expression"):
        load_program(meta, cap.tensors.__getitem__)


class RootState(nn.Module):
    """Parameters and buffers on the root module itself, not only in submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("shift", torch.full((4,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale + self.shift


def test_root_level_parameters_and_buffers_follow_to_and_load():
    model = RootState()
    x = torch.randn(3, 4)
    pm = _roundtrip(export_program(model, (x,)))
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in pm.named_buffers()] == ["shift"]
    pm._apply(lambda t: t.clone())  # what .to(other device) does: new buffer tensors on the root
    with torch.no_grad():
        pm.shift.fill_(2.0)  # as load_state/load_buffers do, in place
        model.shift.fill_(2.0)
    assert torch.equal(pm(x), model(x))


def test_schema_objects_match_torchs_own_conversion():
    """The program's JSON becomes the same export-schema objects as torch's private converter makes
    (dynamic shapes, a loss, BatchNorm buffers, a forward-only program), and unknown fields are ignored."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    from nanreplay.engine.program import _schema_object

    caps = [export_program(TinyTransformer().train(), loss_fn=lm_loss, batch=lm_batch(3, 6), dynamic=True),
            export_program(NestedDropout().train(), loss_fn=criterion_loss, batch=(torch.randn(4, 8), torch.randint(0, 3, (4,)))),
            export_program(models.MLP(), (torch.randn(5, 8),))]
    for cap in caps:
        assert cap.ok, cap.error
        data = json.loads(json.dumps(cap.meta["program"]))
        assert _schema_object(schema.ExportedProgram, data) == _dict_to_dataclass(schema.ExportedProgram, data)
    data["graph_module"]["a_field_of_a_later_torch"] = 1
    assert _schema_object(schema.ExportedProgram, data) == _dict_to_dataclass(schema.ExportedProgram, data)


# -- context managers in the loss function and the model (issue 33, item 5) ------------------------

class Float32Island(nn.Module):
    """A projection, then a float32 island (autocast off) whose log is NaN for a zero row, then a
    head: a model that enters a context manager in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.autocast("cpu", enabled=False):
            h = torch.log(h.float().abs().sum(-1, keepdim=True)) * h.float()
        return self.head(h)


def autocast_loss(model, batch):
    """Enters bf16 autocast around the model call and a no_grad block for its weights."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    with torch.no_grad():
        w = (y.abs() + 1).reciprocal()
    return (((out.float() - y) ** 2) * w).mean()


def test_a_loss_function_entering_autocast_exports_and_replays_from_the_program(out_dir):
    """torch.export keeps each autocast / no_grad block as one higher-order op; the program is
    still cut at the model's call (the loss function's blocks and the model's own), so replay
    needs no factory and names the module as the in-process diagnosis does."""
    torch.manual_seed(0)
    model = Float32Island()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteGradientError) as info:
        with Recorder(model, opt, loss_fn=autocast_loss, out_dir=out_dir, action="raise") as rec:
            for i in range(4):
                x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
                if i == 2:
                    x[3] = 0.0  # log(0) = -inf, times 0: NaN in sample 3
                rec.record((x, y))
                loss = autocast_loss(model, (x, y))
                rec.log_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    path = info.value.bundle_path
    with open_bundle(path) as b:
        assert b.meta[PROGRAM_META_KEY]["kind"] == "loss", b.meta[PROGRAM_META_KEY].get("error")
        assert b.model_factory is None
        live = b.meta["diagnosis"]
    diag = replay(path)
    assert diag["model_source"].startswith("the program embedded in the bundle (forward and loss)")
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    for d in (live, diag):
        assert (d["phase"], d["origin"]["module"], d["origin"]["op"]) == ("forward", "", "log")
        assert d["samples"]["indices"] == [3]


def test_a_failed_export_says_why_in_the_users_terms(caplog):
    """An export that fails names what the code did and the user's line, in the bundle's record
    and on the terminal, not only torch's internal exception."""
    def branching_loss(model, batch):
        out = model(batch[0])
        if out.sum() > 0:  # data-dependent control flow
            return out.mean()
        return out.sum()

    def two_calls(model, batch):
        return model(batch[0]).mean() + model(batch[0] * 2).mean()

    model = nn.Linear(4, 3)
    batch = (torch.randn(5, 4),)
    with caplog.at_level("WARNING", logger="nanreplay"):
        branch = export_program(model, loss_fn=branching_loss, batch=batch)
    assert not branch.ok
    assert branch.error.startswith("the code reads a tensor's value to decide what to run")
    assert "test_program.py" in branch.error and "in branching_loss (`if out.sum() > 0:" in branch.error
    assert branch.error in caplog.text
    twice = export_program(model, loss_fn=two_calls, batch=batch)
    assert twice.error == "the loss function calls the model 2 times; an embedded program holds exactly one call of the model"


def test_custom_autograd_functions_are_listed_and_a_trusted_bundle_replays_their_code(out_dir, tmp_path):
    """torch.export traces a custom autograd.Function through its forward: the program holds
    autograd's derivative of those ops, not the Function's backward. The record lists the
    Function; a trusted bundle replays the recorded factory (the Function's own backward, as in
    training and in the in-process diagnosis), an untrusted one the program, saying so."""
    import shutil
    from pathlib import Path

    from corpus import runner
    from nanreplay import untrust_bundle

    case = runner.load_case(Path(runner.__file__).parent / "cases" / "custom_function_capsule_norm.py")
    rec = runner.record_case(case, out_dir, diagnose=False)
    with open_bundle(rec["bundle"]) as b:
        assert [f.rpartition(":")[2] for f in b.meta[PROGRAM_META_KEY]["custom_functions"]] == ["VecNorm"]
    trusted = replay(rec["bundle"], import_script=True)
    assert trusted["model_source"] == "the model factory recorded in the bundle"
    assert any("custom autograd Functions (VecNorm)" in w and "their own backward runs as in training" in w for w in trusted["warnings"])
    assert trusted["origin"]["node"] == "VecNormBackward"
    stranger = tmp_path / "stranger.h5"
    shutil.copyfile(rec["bundle"], stranger)
    untrust_bundle(stranger)
    untrusted = replay(stranger)
    assert untrusted["model_source"].startswith("the program embedded in the bundle")
    assert any("replays their backward as autograd's derivative of their forward" in w for w in untrusted["warnings"])
    assert untrusted["origin"]["node"] == "SqrtBackward0"

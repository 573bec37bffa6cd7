"""Which operators do real training programs export to, and are they all on nanreplay's allowlist?

Exports the step program (``nanreplay.engine.program.export_program``, the way the Recorder does
at dump time: forward and loss function, the batch dimension dynamic) of

* the bench models (``bench/models.py``: mlp, cnn, gpt),
* every corpus case (``tests/corpus/cases``: the first batch of each, with its loss function),
* tiny GPT-2 and Llama configurations from ``transformers`` (when installed: random weights,
  nothing downloaded), forward and loss,
* a model that was wrapped by ``torch.compile`` (the export sees the original module),

and prints every operator overload, symbolic-size function, higher-order op and string argument
they use, marking those the allowlist (``nanreplay/engine/opset.py``) lacks. Then it loads each
program as an untrusted one and runs it once on its batch: the verifier
(``nanreplay/engine/bounds.py``) proves it in bounds first (the table gives each program's peak
bytes alive and work, and the fraction of its budgets they use) and the index guard
(``nanreplay/engine/guards.py``) watches it run. Exit 1 when an operator is missing or a genuine
program is refused.

Run: ``python bench/opset.py`` (about a minute on 2 cores); ``--json FILE`` writes the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nanreplay.engine import opset  # noqa: E402
from nanreplay.engine.program_check import ProgramRefused  # noqa: E402
from nanreplay.errors import BundleFormatError  # noqa: E402
from nanreplay.engine.program import export_program  # noqa: E402


def _proof(cap: Any, batch: Any) -> Any:
    """Load the program untrusted, prove it on ``batch`` with exact peaks, then run it (under the
    index guard); the :class:`~nanreplay.engine.bounds.Proof`."""
    from nanreplay.engine.bounds import verify_bounds
    from nanreplay.engine.program import _bounds_inputs, _match_inputs, load_program, program_loss

    pm = load_program(cap.meta, cap.tensors.__getitem__)
    bounds = pm._root._nanreplay_bounds
    inputs, names, writable, user = _bounds_inputs(bounds, pm, _match_inputs(cap.meta["inputs"], batch, "the batch"))
    with torch.enable_grad():
        proof = verify_bounds(bounds.gm, inputs, names=names, writable=writable, user=user, exact=True)
        program_loss(pm, batch).backward()
    return proof


def _walk(graph: dict) -> Iterator[tuple[str, dict]]:
    pending = [graph]
    while pending:
        g = pending.pop()
        for n in g["nodes"]:
            yield n["target"], n
            for i in n["inputs"]:
                if "as_graph" in i["arg"]:
                    pending.append(i["arg"]["as_graph"]["graph"])


def _bench_models() -> Iterator[tuple[str, torch.nn.Module, Callable, Any]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanreplay_bench_models", ROOT / "bench" / "models.py")
    bm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bm)  # by path: tests/models.py shares the name
    for name in ("mlp", "cnn", "gpt"):
        factory, make_batch, lossf = bm.spec(name, 0.125)
        torch.manual_seed(0)
        x, y = make_batch(torch.Generator().manual_seed(1), torch.device("cpu"))
        yield f"bench/{name}", factory().train(), (lambda m, b, lossf=lossf: lossf(m(b[0]), b[1])), (x, y)


def _corpus() -> Iterator[tuple[str, torch.nn.Module, Callable, Any]]:
    from corpus.runner import build, case_name, load_cases, seed_all

    for case in load_cases():
        seed_all(0)
        try:
            model, _, _ = build(case)
            batch = next(iter(case.batches()))
        except Exception as e:  # noqa: BLE001 - a case that cannot be built here (a missing extra)
            print(f"  skipped corpus/{case_name(case)}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        yield f"corpus/{case_name(case)}", model, case.loss_fn, batch


def _transformers() -> Iterator[tuple[str, torch.nn.Module, Callable, Any]]:
    try:
        import transformers
    except ImportError:
        print("  skipped transformers models: transformers is not installed", file=sys.stderr)
        return
    from nanreplay.integrations.transformers import hf_loss

    transformers.logging.set_verbosity_error()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, "divide_by": 2}
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                                                bos_token_id=0, eos_token_id=0)).train()
    yield "transformers/gpt2", gpt2, hf_loss, batch
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                                   max_position_embeddings=32)).train()
    yield "transformers/llama", llama, hf_loss, batch


def _compiled() -> Iterator[tuple[str, torch.nn.Module, Callable, Any]]:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(inner)
    x = torch.randn(5, 8)
    y = torch.randint(0, 4, (5,))
    yield "compiled/mlp", compiled._orig_mod, (lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])), (x, y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write {operator: [models]} and the missing ones to this file")
    args = ap.parse_args(argv)
    used: dict[str, set[str]] = collections.defaultdict(set)
    failed = []
    proofs: list[tuple[str, Any]] = []
    refused, unloadable = [], []
    for source in (_bench_models, _corpus, _transformers, _compiled):
        for name, model, loss_fn, batch in source():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cap = export_program(model, loss_fn=loss_fn, batch=batch, dynamic="batch", verify=False)
            if not cap.ok:
                failed.append(f"{name}: {cap.error}")
                continue
            try:
                proofs.append((name, _proof(cap, batch)))
            except (ProgramRefused, BundleFormatError) as e:  # a genuine program the verifier or the guard refuses
                refused.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            except Exception as e:  # noqa: BLE001 - a program replay cannot load for another reason (not the verifier's)
                unloadable.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            for target, node in _walk(cap.meta["program"]["graph_module"]["graph"]):
                used[target].add(name)
                for inp in node["inputs"]:
                    if "as_string" in inp["arg"]:
                        used[f"{target} {inp['name']}={inp['arg']['as_string']!r}"].add(name)
    missing = []
    for key in sorted(used):
        target = key.split(" ")[0]
        if target.startswith("torch.ops.aten."):
            name = target[len("torch.ops.aten."):]
        elif target.startswith("torch.ops.higher_order."):
            name = "higher_order." + target.rsplit(".", 1)[1]
        else:
            name = target
        ok = opset.allowed(name) or name in opset.SYM_FUNCTIONS
        if ok and " " in key:
            arg, _, value = key.split(" ", 1)[1].partition("=")
            ok = opset.string_allowed(name, arg, value.strip("'\""))
        if not ok:
            missing.append(key)
        print(f"{'  ' if ok else '! '}{key:<70} {len(used[key]):3d} models")
    models = sorted({m for ms in used.values() for m in ms})
    print(f"\n{len(models)} models exported, {len(failed)} could not be; {len(used)} operators and string arguments used, "
          f"{len(missing)} missing from the allowlist ({len(opset.OPS)} aten overloads, {len(opset.HIGHER_ORDER)} higher-order ops, "
          f"{len(opset.SYM_FUNCTIONS)} symbolic-size functions)")
    for f in failed:
        print(f"  export failed: {f[:160]}")
    print(f"\n{'program':<48} {'nodes':>5} {'real bytes':>11} {'peak alive':>11} {'of budget':>9} {'work':>14} {'of budget':>9} {'proof s':>7}")
    for name, p in proofs:
        b = p.budget
        print(f"{name:<48} {p.nodes:5d} {b.real_bytes:11,d} {p.peak_bytes:11,d} {p.peak_bytes / b.bytes:9.2%} {p.work:14,d} "
              f"{p.work / b.work:9.2%} {p.seconds:7.3f}")
    if proofs:
        worst = max(proofs, key=lambda x: x[1].peak_bytes / max(x[1].budget.real_bytes, 1))[1]
        print(f"largest peak / real bytes: {worst.peak_bytes / max(worst.budget.real_bytes, 1):.1f}; "
              f"largest work / (real x input elements): {max(p.work / max(p.budget.real_elements * max(p.budget.input_elements, 1), 1) for _, p in proofs):.2f}")
    for r in unloadable:
        print(f"  not loaded (a limit of program replay, not of the verifier): {r}")
    for r in refused:
        print(f"! refused: {r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"used": {k: sorted(v) for k, v in used.items()}, "missing": missing, "models": models,
                                               "failed": failed, "refused": refused,
                                               "proofs": {n: {"nodes": p.nodes, "real_bytes": p.budget.real_bytes, "peak_bytes": p.peak_bytes,
                                                              "work": p.work, "budget_bytes": p.budget.bytes, "budget_work": p.budget.work,
                                                              "seconds": round(p.seconds, 4)} for n, p in proofs}}, indent=1))
    return 1 if missing or refused else 0


if __name__ == "__main__":
    sys.exit(main())

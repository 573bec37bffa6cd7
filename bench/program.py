"""What embedding the failing step's program in a bundle costs: export time at dump time, load
time at replay, and size (the JSON program, the tensors it stores itself) beside the plain
weights, for the three bench models and Hugging Face GPT-2 models built from configs.

Each model is exported with its loss function (kind ``"loss"``: forward + loss, what
``program_content`` tries first) on one batch, in training mode, with the weights shared with the
bundle's ``state/params`` (so the program stores only tensors the bundle does not hold anyway:
constants created in forward). Then the program is loaded back from its JSON text and checked
bit for bit against the eager model (loss and every gradient, same RNG state).

    python bench/program.py                 # the table below, a few minutes on 2 CPU cores
    python bench/program.py --dynamic       # also time the export with dynamic shapes
    python bench/program.py --models mlp,gpt2-tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as bench_models  # noqa: E402

from nanreplay.engine.program import export_program, load_program, program_loss  # noqa: E402


def _bench(name: str, scale: float = 1.0):
    factory, make_batch, lossf = bench_models.spec(name, scale)

    def loss_fn(m, b):
        return lossf(m(b[0]), b[1])

    torch.manual_seed(0)
    return factory().train(), loss_fn, make_batch(torch.Generator().manual_seed(1), torch.device("cpu"))


def _gpt2(cfg_kwargs: dict, seq: int):
    import transformers

    from nanreplay.integrations.transformers import hf_loss

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **cfg_kwargs)).train()
    ids = torch.randint(1, model.config.vocab_size, (4, seq), generator=torch.Generator().manual_seed(1))
    return model, hf_loss, {"inputs": {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}}


MODELS = {
    "mlp": lambda: _bench("mlp"),
    "cnn": lambda: _bench("cnn"),
    "gpt": lambda: _bench("gpt"),
    "gpt2-tiny": lambda: _gpt2({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}, 64),
    "gpt2-124M": lambda: _gpt2({}, 128),  # GPT2Config() defaults: 12 layers, 768 wide, 50257 tokens
}


def _grads(m):
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def measure(name: str, dynamic: bool) -> dict:
    model, loss_fn, batch = MODELS[name]()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shared = {id(p): f"state/params/{n}" for n, p in model.named_parameters()}
    shared.update({id(b): f"state/buffers/{n}" for n, b in model.named_buffers()})
    export_program(model, loss_fn=loss_fn, batch=batch, shared=shared, verify=False)  # warm-up (first export imports and caches)
    t0 = time.perf_counter()
    cap = export_program(model, loss_fn=loss_fn, batch=batch, shared=shared, verify=False)
    export_s = time.perf_counter() - t0
    assert cap.ok, cap.error
    text = json.dumps(cap.meta, allow_nan=False)
    meta = json.loads(text)
    state = {**{f"state/params/{n}": p.detach() for n, p in model.named_parameters()},
             **{f"state/buffers/{n}": b for n, b in model.named_buffers()}, **cap.tensors}
    t0 = time.perf_counter()
    pm = load_program(meta, state.__getitem__)
    load_s = time.perf_counter() - t0
    eager = copy.deepcopy(model)
    torch.manual_seed(7)
    l1 = loss_fn(eager, batch)
    l1.backward()
    torch.manual_seed(7)
    l2 = program_loss(pm, batch)
    l2.backward()
    g1, g2 = _grads(eager), _grads(pm)
    exact = torch.equal(l1, l2) and list(g1) == list(g2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    row = {
        "model": name,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "weights_mib": weights / 2**20,
        "export_s": export_s,
        "load_s": load_s,
        "program_json_kib": cap.meta["json_bytes"] / 1024,
        "record_kib": len(text) / 1024,
        "own_tensor_bytes": sum(t.numel() * t.element_size() for t in cap.tensors.values()),
        "nodes": sum(1 for n in cap.meta["program"]["graph_module"]["graph"]["nodes"]),
        "bit_exact": exact,
    }
    if dynamic:
        t0 = time.perf_counter()
        dcap = export_program(model, loss_fn=loss_fn, batch=batch, shared=shared, verify=False, dynamic=True)
        row["dynamic_export_s"] = time.perf_counter() - t0 if dcap.ok and dcap.meta["dynamic"] else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    ap.add_argument("--dynamic", action="store_true", help="also time the export with dynamic shapes")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = [measure(n, args.dynamic) for n in args.models.split(",")]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, python {platform.python_version()}; "
          f"command: python bench/program.py{' --dynamic' if args.dynamic else ''}")
    print()
    head = "| model | params | weights | export (s) | load (s) | program JSON | whole record | own tensors | JSON / weights | graph nodes | bit-exact |"
    # own tensors: what the program stores beside the bundle's state/params and state/buffers
    if args.dynamic:
        head = head.replace("| load (s)", "| dynamic export (s) | load (s)")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        dyn = f" {r['dynamic_export_s']:.2f} |" if args.dynamic and r.get("dynamic_export_s") is not None else (" failed |" if args.dynamic else "")
        print(
            f"| {r['model']} | {r['params_m']:.2f} M | {r['weights_mib']:.1f} MiB | {r['export_s']:.2f} |{dyn} {r['load_s']:.2f} | "
            f"{r['program_json_kib']:.0f} KiB | {r['record_kib']:.0f} KiB | {r['own_tensor_bytes']} B | "
            f"{100 * r['program_json_kib'] / 1024 / r['weights_mib']:.2f}% | {r['nodes']} | {'yes' if r['bit_exact'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()

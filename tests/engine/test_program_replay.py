"""A bundle replays without the user's code: the program embedded at dump time is what replay runs.

Each case trains in a subprocess from a temporary directory holding the model code, fails, and
writes a bundle; then the directory's code is deleted and the bundle replays in this process to the
same diagnosis as the one made in training, with the model rebuilt from the bundle alone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nanreplay
from nanreplay import open_bundle

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    from nanreplay import NonFiniteGradientError, Recorder

    NAME, OUT = sys.argv[1], sys.argv[2]

    if NAME == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        def make_model():
            torch.manual_seed(0)
            return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))

        def make_batch(g):
            ids = torch.randint(0, 64, (4, 16), generator=g)
            return ids, ids

        def base_loss(model, x, y):
            return model(input_ids=x, labels=y).loss
    else:
        from benchmodels import spec

        factory, batch_of, loss_of = spec(NAME, 0.125)

        def make_model():
            torch.manual_seed(0)
            return factory()

        def make_batch(g):
            return batch_of(g, torch.device("cpu"))

        def base_loss(model, x, y):
            return loss_of(model(x), y)

    def step_loss(model, batch):
        x, y, weight = batch
        return base_loss(model, x, y) / weight.sum()  # the batch's weights sum to 0 at step 2: x / 0

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with Recorder(model, opt, loss_fn=step_loss, model_factory=make_model, out_dir=OUT) as rec:
        try:
            for step in range(4):
                x, y = make_batch(g)
                weight = torch.ones(x.shape[0]) if step != 2 else torch.zeros(x.shape[0])
                rec.record((x, y, weight))
                loss = step_loss(model, (x, y, weight))
                opt.zero_grad()
                loss.backward()
                opt.step()
        except NonFiniteGradientError as e:
            print(e.bundle_path)
''')


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt2"])
def test_bundle_replays_with_the_model_code_deleted(tmp_path, name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(REPO / "bench" / "models.py", code / "benchmodels.py")
    (code / "train.py").write_text(TRAIN)
    out = subprocess.run([sys.executable, "train.py", name, str(tmp_path / "bundles")], cwd=code, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    bundle = out.stdout.strip().splitlines()[-1]
    with open_bundle(bundle) as b:
        recorded = b.diagnosis
        assert b.meta["program"]["kind"] == "loss", b.meta["program"].get("error")
        # the source lines were cut to the user's frames when the program was exported: no torch or
        # nanreplay file, whose paths would differ (and be taken for the user's) in another environment
        files = set(re.findall(r'File "([^"]+)"', "\n".join(_stack_traces(b.meta["program"]["program"]))))
        torch_dir, own_dir = str(Path(torch.__file__).parent), str(REPO / "nanreplay")
        assert "train.py" in {Path(f).name for f in files}, files
        assert not [f for f in files if f.startswith((torch_dir, own_dir)) or "/python3." in f and "-packages/" not in f], files
    shutil.rmtree(code)  # the user's code is gone from this machine

    diag = nanreplay.replay(bundle)
    assert diag["model_source"] == "the program embedded in the bundle (forward and loss)"
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    # float per-sample weights that sum to 0: continuous batch values at the division's singular point
    # (issue 19's rule: only integer/bool leaves, or the batch's size or composition, make it bad input data)
    assert (diag["phase"], diag["origin"]["op"], diag["classification"]["cause"]) == ("loss", "div", "numerics")
    assert diag["summary"] == recorded["summary"], "the replay without the code says what training said"
    assert diag["origin"]["source"]["function"] == "step_loss" and diag["origin"]["source"]["file"].endswith("train.py")
    # the line's code comes from the bundle: the file is gone
    assert diag["origin"]["source"]["code"].startswith("return base_loss(model, x, y) / weight.sum()"), diag["origin"]["source"]


def _stack_traces(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "stack_trace" and isinstance(v, str):
                yield v
            else:
                yield from _stack_traces(v)
    elif isinstance(node, list):
        for v in node:
            yield from _stack_traces(v)


def test_a_stack_trace_recorded_under_another_environment_names_the_users_line():
    """A bundle written before the traces were cut (or by another writer) holds torch's frames at
    the recording machine's paths: they are still torch's, whatever environment replays."""
    from nanreplay.engine.probes import user_frame_of_traceback, user_frames_only

    trace = (
        '  File "/home/u/proj/model.py", line 16, in forward\n    return torch.sqrt(h - 1)\n'
        '  File "/opt/other-env/lib/python3.10/site-packages/torch/fx/proxy.py", line 287, in create_node\n'
        '    user_stack_summary = CapturedTraceback.extract().summary()\n'
        '  File "/srv/venv/lib/python3.12/site-packages/nanreplay/engine/program.py", line 9, in _export\n    return torch.export.export(root)\n'
    )
    frame = user_frame_of_traceback([trace])
    assert (Path(frame["file"]).name, frame["line"], frame["code"]) == ("model.py", 16, "return torch.sqrt(h - 1)")
    assert user_frames_only(trace) == '  File "/home/u/proj/model.py", line 16, in forward\n    return torch.sqrt(h - 1)\n'

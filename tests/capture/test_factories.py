"""Recorded factories resolve where the training ran: a factory in a module next to the training
script, and a factory inside the training script itself (which replay must not run again)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanreplay import open_bundle, replay
from nanreplay.core.callables import CallablePath, callable_path, import_callable, script_imports, script_runs_code
from nanreplay.errors import ReplayError

REPO = Path(__file__).resolve().parents[2]

MODEL_PY = '''
import torch, torch.nn as nn

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def step_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
'''

TRAIN_LOOP = '''
def train(out, embed_program=False):
    import torch
    from nanreplay import Recorder, NonFiniteGradientError
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with Recorder(model, opt, loss_fn=step_loss, model_factory=make_model, out_dir=out, diagnose=False, embed_program=embed_program) as rec:
        for step in range(3):
            xb = x.clone()
            if step == 2:
                xb[1, 0] = float("nan")
            rec.record((xb, y))
            loss = step_loss(model, (xb, y))
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                print("BUNDLE", e.bundle_path)
                return
            opt.zero_grad()
'''


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)  # nanreplay itself; the project directory is NOT on the path
    return env


def _launcher(tmp_path: Path) -> Path:
    """Like the ``nanreplay`` console script: sys.path[0] is the script's directory, not the cwd."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    f = d / "nanreplay_cli.py"
    f.write_text("import sys\nfrom nanreplay.cli import main\nsys.exit(main())\n")
    return f


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)


def _bundle_of(proc: subprocess.CompletedProcess) -> Path:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BUNDLE ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return Path(lines[-1].split(" ", 1)[1])


@pytest.mark.slow
def test_sibling_module_factory_replays_from_the_same_directory(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "model.py").write_text(MODEL_PY)
    (proj / "train.py").write_text("from model import make_model, step_loss\n" + TRAIN_LOOP + '\nif __name__ == "__main__":\n    train("bundles")\n')
    bundle = proj / _bundle_of(_run(["train.py"], proj))
    with open_bundle(bundle) as b:
        assert b.model_factory == "model:make_model" and b.loss_fn == "model:step_loss"
        assert b.model_factory.root == str(proj.resolve()) and b.meta["callables"]["loss_fn"]["root"] == str(proj.resolve())
    cli = _launcher(tmp_path)
    proc = _run([cli, "replay", bundle, "--no-ops", "--no-samples"], proj)  # no PYTHONPATH=.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproduced exactly" in proc.stdout
    # the project moved away: the message names the recorded directory and PYTHONPATH
    moved = tmp_path / "elsewhere"
    proj.rename(moved)
    with pytest.raises(ReplayError) as info:
        replay(moved / "bundles" / bundle.name, ops=False)
    msg = str(info.value)
    assert str(proj.resolve()) in msg and "does not exist here" in msg and "PYTHONPATH" in msg


@pytest.mark.slow
def test_unguarded_training_script_is_not_run_again_by_replay(tmp_path, monkeypatch, caplog):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        MODEL_PY + TRAIN_LOOP
        + '\nwith open("marker.txt", "a") as f:\n    f.write("trained\\n")\ntrain("bundles")\n'  # no __main__ guard
    )
    bundle = proj / _bundle_of(_run(["train.py"], proj))
    with open_bundle(bundle) as b:
        script = str((proj / "train.py").resolve())
        assert b.model_factory == f"{script}:make_model" and b.model_factory.script == script
    stamp = bundle.stat().st_mtime_ns
    cli = _launcher(tmp_path)
    proc = _run([cli, "replay", bundle, "--no-ops"], proj)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "would start the training again" in proc.stderr and "--import-script" in proc.stderr and "embedded program" in proc.stderr
    assert "line " in proc.stderr and "with open" in proc.stderr  # names the statement that runs at import
    assert (proj / "marker.txt").read_text() == "trained\n"  # the training loop did not run again
    assert sorted(p.name for p in (proj / "bundles").iterdir()) == [bundle.name] and bundle.stat().st_mtime_ns == stamp
    # the user says so: imported with a warning (it trains again, as asked), then replayed
    monkeypatch.chdir(proj)
    with caplog.at_level(logging.WARNING, logger="nanreplay.core.callables"):
        diag = replay(bundle, ops=False, samples=False, import_script=True)
    assert diag["reproduction"]["verdict"] == "reproduced exactly"
    assert "runs its top-level code" in caplog.text
    assert (proj / "marker.txt").read_text() == "trained\ntrained\n"


@pytest.mark.slow
def test_unguarded_training_script_with_an_embedded_program_is_never_imported(tmp_path):
    """With the step's program in the bundle (the default), replay runs it: the script is not imported."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        MODEL_PY + TRAIN_LOOP + '\nwith open("marker.txt", "a") as f:\n    f.write("trained\\n")\ntrain("bundles", embed_program=True)\n'
    )
    bundle = proj / _bundle_of(_run(["train.py"], proj))
    proc = _run([_launcher(tmp_path), "replay", bundle, "--no-ops"], proj)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproduced exactly" in proc.stdout
    assert (proj / "marker.txt").read_text() == "trained\n"  # the training loop did not run again


@pytest.mark.slow
def test_replay_inside_the_running_script_uses_its_module(tmp_path):
    """In the training process itself, the recorded __main__ callables are the running ones: no import."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        MODEL_PY + TRAIN_LOOP + textwrap.dedent('''
        import io, contextlib, nanreplay
        with open("marker.txt", "a") as f:
            f.write("trained\\n")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            train("bundles")
        path = buf.getvalue().split("BUNDLE ", 1)[1].strip()
        print("VERDICT", nanreplay.replay(path, ops=False, samples=False)["reproduction"]["verdict"])
        ''')
    )
    proc = _run(["train.py"], proj)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VERDICT reproduced exactly" in proc.stdout
    assert (proj / "marker.txt").read_text() == "trained\n"


def test_script_runs_code_reads_the_top_level(tmp_path):
    f = tmp_path / "s.py"
    f.write_text('"""doc"""\nimport torch\nX = (2, [3])\nsq = lambda x: torch.sqrt(x)\ndef f(a=1):\n    torch.zeros(2)\n'
                 'class C:\n    n = 3\n    def m(self):\n        print(1)\nif __name__ == "__main__":\n    f()\n')
    assert script_runs_code(f) is None
    # any call at import counts: an assignment, a decorator, a default, a class body, a comprehension (issue 18)
    for code, line in [("import torch\n_ = torch.zeros(2)\n", "line 2: _ = torch.zeros(2)"),
                       ("import os\n_ = os.system('touch x')\n", "line 2: _ = os.system('touch x')"),
                       ("import dataclasses\n@dataclasses.dataclass\nclass B:\n    x: int = 0\n", "line 2: @dataclasses.dataclass"),
                       ("def f(a=open('x')):\n    pass\n", "line 1: def f(a=open('x')):"),
                       ("class K:\n    y = print('hi')\n", "line 2:     y = print('hi')".replace("    ", "", 1)),
                       ("xs = [i for i in range(3)]\n", "line 1: xs = [i for i in range(3)]"),
                       ("class M(metaclass=Meta):\n    pass\n", "line 1: class M(metaclass=Meta):")]:
        f.write_text(code)
        assert script_runs_code(f) == line, code
    f.write_text("import torch\ndef f():\n    pass\nf()\n")
    assert script_runs_code(f) == "line 4: f()"
    f.write_text("for i in range(3):\n    pass\n")
    assert script_runs_code(f).startswith("line 1: for i in range(3)")
    f.write_text("def broken(:\n")
    assert "cannot be parsed" in script_runs_code(f)


def test_callable_path_records_the_root_and_old_strings_still_import(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text("def make():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import mypkg.factories

    p = callable_path(mypkg.factories.make)
    assert isinstance(p, CallablePath) and p == "mypkg.factories:make" and p.root == str((tmp_path / "src").resolve())
    assert callable_path(callable_path) == "nanreplay.core.callables:callable_path"
    import torch

    assert callable_path(torch.nn.Linear).root is None  # an installed package: nothing to record
    # a plain string (an old bundle) still imports
    assert import_callable("mypkg.factories:make")() == 42
    # the recorded root makes a module importable that is not on sys.path any more
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [x for x in sys.path if x != str(tmp_path / "src")])
    with pytest.raises(ReplayError, match="PYTHONPATH"):
        import_callable("mypkg.factories:make")
    assert import_callable(CallablePath("mypkg.factories:make", root=str(tmp_path / "src")))() == 42


def test_script_imports_allows_an_unguarded_file(tmp_path):
    f = tmp_path / "loose.py"
    f.write_text("COUNT = []\nCOUNT.append(1)\ndef make():\n    return len(COUNT)\n")
    with pytest.raises(ReplayError, match="import-script"):
        import_callable(f"{f}:make")
    with script_imports():
        with script_imports(False):  # False keeps the enclosing permission
            assert import_callable(f"{f}:make")() == 1

"""The verdict where the run is logged (``log_to``, ``nanreplay log``), read back with each tracker's
own reader: TensorBoard's ``EventAccumulator``, the records of a W&B offline run file decoded with
wandb's own protobuf, MLflow's ``MlflowClient`` on a local store. Each is skipped only when its
library (the ``trackers`` extra) is absent; nothing reaches the network (W&B runs offline)."""

from __future__ import annotations

import glob
import json
import logging
import math
import struct

import pytest
import torch
from click.testing import CliRunner

from nanreplay import Recorder
from nanreplay.core.inert import inert_markdown
from nanreplay.capture.early import Z_SPIKE
from nanreplay.capture.trackers import Tracker, Trackers, event_from_meta, resolve
from nanreplay.cli import main
from nanreplay.format.bundle import open_bundle

BAD_STEP = 3


def ratio_loss(model, batch):
    """A loss that divides by the batch's count of positive targets: 0 in the planted batch."""
    x, y = batch
    return ((model(x) - y) ** 2).sum() / (y > 0).sum()


def _nan_run(tmp_path, log_to, steps: int = 6, **opts) -> Recorder:
    """A plain loop whose step BAD_STEP has no positive target (0/0 in the loss); action='warn'
    so that training goes on past it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    opts = {"action": "warn", "embed_program": False, "out_dir": tmp_path / "bundles", **opts}
    with Recorder(net, opt, loss_fn=ratio_loss, log_to=log_to, **opts) as rec:
        for step in range(steps):
            x, y = torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g) + 0.1
            if step == BAD_STEP:
                y = -y
            rec.record((x, y))
            loss = ratio_loss(net, (x, y))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return rec


def _spike_run(log_to) -> Recorder:
    """The README's learning-rate range test that goes too far: a spike at step 41 (the lr)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with Recorder(net, opt, capacity=4, action="warn", diagnose=False, embed_program=False, log_to=log_to) as rec:
        for step in range(45):
            for grp in opt.param_groups:
                grp["lr"] = 0.01 * 1.5 ** max(0, step - 39)
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return rec


class Collect(Tracker):
    """A tracker that keeps what it is given (the events and the files' names and bytes)."""

    name = "collect"
    artifacts = True

    def __init__(self):
        self.events, self.files = [], []

    def log(self, event, files):
        self.events.append(event)
        self.files.append({f.name: f.stat().st_size for f in files})


# -- TensorBoard --------------------------------------------------------------------------------
def _tb_events(logdir):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(logdir))
    ea.Reload()
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors(t)] for t in ea.Tags()["tensors"]}
    scalars = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
    return texts, scalars


def test_a_summarywriter_gets_the_sentence_and_the_step(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    rec = _nan_run(tmp_path, writer)
    writer.close()
    assert rec.nonfinite_steps[0] == BAD_STEP and rec.bundles
    texts, scalars = _tb_events(tmp_path / "tb")
    assert scalars == {"nanreplay/nonfinite_step": [(BAD_STEP, float(BAD_STEP))]}
    [(step, text)] = texts["nanreplay/nonfinite/text_summary"]
    assert step == BAD_STEP
    assert text.startswith(inert_markdown(rec.last_diagnosis["summary"]))  # the sentence (escaped for Markdown), then the tags
    assert "* phase: loss" in text and f"* cause: {rec.last_diagnosis['classification']['cause']}" in text
    assert f"* bundle: {inert_markdown(rec.bundles[0].resolve())}" in text  # TensorBoard keeps no artifacts: the path


def test_a_spike_episode_is_logged_once_with_its_score(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer, seen = SummaryWriter(str(tmp_path / "tb")), Collect()
    rec = _spike_run([writer, seen])
    writer.close()
    first = rec.spikes[0]
    spikes = [e for e in seen.events if e.kind == "spike"]
    assert [e.step for e in spikes] == [first["step"]]  # one event per episode, not per spike step
    ev = spikes[0]
    assert ev.scalars["spike_score"] == pytest.approx(max(r["score"] for r in rec.spikes if r["step"] == first["step"]))
    assert ev.scalars["spike_score"] > Z_SPIKE and ev.tags["signal"].startswith("lr (spike)")
    assert ev.sentence.startswith(f"early warning at step {first['step']}: lr ")
    _, scalars = _tb_events(tmp_path / "tb")
    assert scalars["nanreplay/spike_score"] == [(first["step"], pytest.approx(ev.scalars["spike_score"], rel=1e-6))]


# -- W&B (offline) ------------------------------------------------------------------------------
def _wandb_records(run_dir):
    """The records of a W&B run file (``run-<id>.wandb``): wandb's LevelDB-style log (a 7-byte
    header ``:W&B``, 0xBEE1, version; 32 KiB blocks of chunks, each ``crc, length, type``), each
    record one ``wandb_internal_pb2.Record`` decoded with wandb's own protobuf."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    pytest.importorskip("wandb").teardown()  # the run file is written by wandb's service process: stop it, so it is complete
    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))  # latest-run links to it
    data = open(path, "rb").read()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            r = pb.Record()
            r.ParseFromString(pending)
            out.append(r)
            pending = b""
    return out


def _wandb_view(run_dir):
    history, summary, artifacts = [], {}, []
    for r in _wandb_records(run_dir):
        t = r.WhichOneof("record_type")
        if t == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
        elif t == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
        elif t == "artifact":
            artifacts.append((r.artifact.name, r.artifact.type, sorted(c.path for c in r.artifact.manifest.contents)))
    return history, summary, artifacts


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    wandb.teardown()  # wandb keeps its settings (WANDB_DIR) in a process-wide singleton: start afresh
    yield wandb
    wandb.teardown()


def test_a_wandb_offline_run_gets_scalars_summary_and_the_bundle_artifact(tmp_path, wandb_offline):
    run = wandb_offline.init(project="nanreplay-test", mode="offline", dir=str(tmp_path / "wb"))
    rec = _nan_run(tmp_path, run)
    run.finish()
    history, summary, artifacts = _wandb_view(tmp_path / "wb")
    assert any(h.get("nanreplay/nonfinite_step") == BAD_STEP for h in history), (history, summary)
    assert summary["nanreplay/nonfinite"] == inert_markdown(rec.last_diagnosis["summary"])
    assert summary["nanreplay/phase"] == "loss" and summary["nanreplay/cause"] == rec.last_diagnosis["classification"]["cause"]
    assert summary["nanreplay/bundle"] == inert_markdown(rec.bundles[0].resolve())
    expected = sorted([rec.bundles[0].name] + (["nanreplay-step3.html"] if _has_matplotlib() else []))
    assert artifacts == [("nanreplay-step3", "nanreplay-bundle", expected)]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- MLflow (local file store) ------------------------------------------------------------------
@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # mlflow.set_tracking_uri (which Lightning's MLFlowLogger calls) outranks the variable, process-wide: forget it
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    return mlflow, uri


def _mlflow_view(mlflow, uri, run_id):
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    files = sorted(f.path for f in client.list_artifacts(run_id, "nanreplay"))
    return client, run.data.metrics, run.data.tags, files


def test_an_mlflow_run_gets_metrics_tags_text_and_artifacts(tmp_path, mlflow_store):
    mlflow, uri = mlflow_store
    with mlflow.start_run() as active:
        rec = _nan_run(tmp_path, active)
    client, metrics, tags, files = _mlflow_view(mlflow, uri, active.info.run_id)
    assert metrics["nanreplay.nonfinite_step"] == BAD_STEP
    assert [m.step for m in client.get_metric_history(active.info.run_id, "nanreplay.nonfinite_step")] == [BAD_STEP]
    assert tags["nanreplay.phase"] == "loss" and tags["nanreplay.cause"] == rec.last_diagnosis["classification"]["cause"]
    assert tags["nanreplay.bundle"] == inert_markdown(rec.bundles[0].resolve())
    expected = {f"nanreplay/{rec.bundles[0].name}", "nanreplay/nanreplay-step3.md"} | ({"nanreplay/nanreplay-step3.html"} if _has_matplotlib() else set())
    assert set(files) == expected
    text = mlflow.artifacts.load_text(f"{active.info.artifact_uri}/nanreplay/nanreplay-step3.md")
    assert text.startswith(inert_markdown(rec.last_diagnosis["summary"]))
    # the bundle kept by MLflow is the bundle: it opens and has the failing step
    local = client.download_artifacts(active.info.run_id, f"nanreplay/{rec.bundles[0].name}", str(tmp_path / "dl"))
    with open_bundle(local) as b:
        assert b.failing_step == BAD_STEP and b.meta["diagnosis"]["summary"] == rec.last_diagnosis["summary"]


# -- failures, choices, limits ------------------------------------------------------------------
def test_a_failing_tracker_warns_and_never_stops_training(tmp_path, caplog):
    def broken(event):
        raise ConnectionError("tracker down")

    seen = Collect()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        rec = _nan_run(tmp_path, [broken, seen], steps=6)
    assert rec.step == 6  # every step ran
    assert [e.step for e in seen.events] == [BAD_STEP]  # the other tracker still got the event
    assert f"could not log step {BAD_STEP}'s nonfinite to " in caplog.text and "ConnectionError: tracker down" in caplog.text
    assert "training goes on" in caplog.text


def test_an_unknown_log_to_is_refused_at_construction():
    net = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"log_to: expected a TensorBoard SummaryWriter.*found builtins\.object; pass one of those"):
        Recorder(net, torch.optim.SGD(net.parameters(), lr=0.1), log_to=object())
    assert resolve([object(), None], strict=False) == []  # what a framework callback finds is skipped instead


def test_a_bundle_over_the_artifact_limit_is_named_not_copied(tmp_path, caplog):
    rec = _nan_run(tmp_path, None)
    meta = dict(open_bundle(rec.bundles[0]).meta)
    seen = Collect()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        Trackers(seen, artifact_max_bytes=100, html=False).emit(event_from_meta(rec.bundles[0], meta))
    assert seen.files == [{}]
    assert seen.events[0].tags["bundle_artifact"].startswith("not copied: ")
    assert "over the 0 MiB copied to a tracker's artifacts" in caplog.text
    Trackers(seen, html=False).emit(event_from_meta(rec.bundles[0], meta))
    assert seen.files[1] == {rec.bundles[0].name: rec.bundles[0].stat().st_size}


def test_an_undiagnosed_bundle_says_what_was_found_and_how_to_replay(tmp_path):
    seen = Collect()
    rec = _nan_run(tmp_path, seen, diagnose=False)
    [ev] = seen.events
    assert ev.diagnosis is None and ev.step == BAD_STEP
    assert ev.sentence.startswith(f"non-finite gradients and loss at step {BAD_STEP}; not diagnosed yet: `nanreplay replay ")
    assert [list(f) for f in seen.files] == [[rec.bundles[0].name]]  # no diagnosis: no HTML report
    # (the file's size moved since: close() rewrote it with the plan of the whole episode, steps 3..5 under action="warn")
    with open_bundle(rec.bundles[0]) as b:
        assert b.meta["reason"]["rollback"]["skip_steps"] == [BAD_STEP, BAD_STEP + 1, BAD_STEP + 2]


# -- nanreplay log ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diagnosed_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("log")
    rec = _nan_run(tmp, None)
    return rec.bundles[0], rec.last_diagnosis


def test_log_to_tensorboard_after_the_fact(tmp_path, diagnosed_bundle, monkeypatch):
    pytest.importorskip("tensorboard")
    bundle, diag = diagnosed_bundle
    monkeypatch.setenv("NANREPLAY_HOME", str(tmp_path / "home"))  # an empty trust store: the bundle is untrusted
    res = CliRunner().invoke(main, ["log", str(bundle), "--to", f"tensorboard:{tmp_path / 'tb'}"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"{bundle}: step {BAD_STEP}'s nonfinite verdict logged to tensorboard:")
    texts, scalars = _tb_events(tmp_path / "tb")
    assert scalars == {"nanreplay/nonfinite_step": [(BAD_STEP, float(BAD_STEP))]}
    assert texts["nanreplay/nonfinite/text_summary"][0][1].startswith(inert_markdown(diag["summary"]))


def test_log_to_wandb_and_mlflow_after_the_fact(tmp_path, diagnosed_bundle, wandb_offline, mlflow_store):
    mlflow, uri = mlflow_store
    bundle, diag = diagnosed_bundle
    res = CliRunner().invoke(main, ["log", str(bundle), "--to", "wandb:nanreplay-test", "--to", f"mlflow:{uri}"])
    assert res.exit_code == 0, res.output
    _, summary, artifacts = _wandb_view(tmp_path / "wb")
    assert summary["nanreplay/nonfinite"] == inert_markdown(diag["summary"])
    assert artifacts[0][0] == "nanreplay-step3" and bundle.name in artifacts[0][2]
    [run] = mlflow.MlflowClient(tracking_uri=uri).search_runs([mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name("nanreplay").experiment_id])
    assert run.info.run_name == bundle.stem and run.info.status == "FINISHED"
    _, metrics, tags, files = _mlflow_view(mlflow, uri, run.info.run_id)
    assert metrics["nanreplay.nonfinite_step"] == BAD_STEP and tags["nanreplay.phase"] == diag["phase"]
    assert f"nanreplay/{bundle.name}" in files


@pytest.mark.parametrize("spec, message", [
    ("tensorboard", "--to 'tensorboard': no KIND: prefix; expected one of tensorboard:DIR | wandb:PROJECT | mlflow:URI"),
    ("neptune:x", "--to 'neptune:x': unknown tracker 'neptune'; expected one of tensorboard:DIR"),
    ("wandb:", "--to 'wandb:': a project name is missing; expected one of"),
])
def test_log_refuses_a_bad_to_with_exit_2(diagnosed_bundle, spec, message):
    res = CliRunner().invoke(main, ["log", str(diagnosed_bundle[0]), "--to", spec])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"Error: {message}" in res.output


def test_log_of_a_missing_bundle_exits_4(tmp_path):
    res = CliRunner().invoke(main, ["log", str(tmp_path / "nope.h5"), "--to", f"tensorboard:{tmp_path}"])
    assert res.exit_code in (2, 4) and "Traceback" not in res.output


def test_a_spike_bundle_is_logged_as_a_spike(tmp_path):
    seen = Collect()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with Recorder(net, opt, action="warn", on_spike="dump", embed_program=False, out_dir=tmp_path, log_to=seen) as rec:
        for step in range(42):
            for grp in opt.param_groups:
                grp["lr"] = 0.01 * 1.5 ** max(0, step - 39)
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
            rec.log_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    [spike_bundle] = rec._dump.spike_bundles
    [live] = seen.events
    assert live.kind == "spike" and live.bundle == spike_bundle and spike_bundle.name in seen.files[0]
    later = event_from_meta(spike_bundle, dict(open_bundle(spike_bundle).meta))  # what `nanreplay log` sends
    assert (later.kind, later.step, later.tags["signal"]) == ("spike", live.step, live.tags["signal"])
    assert math.isclose(later.scalars["spike_score"], live.scalars["spike_score"])


# -- the framework callbacks: the trainer's own loggers, no new configuration ---------------------
def test_lightning_logs_the_verdict_to_the_trainers_loggers(tmp_path, wandb_offline, mlflow_store):
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from test_lightning import BAD_STEP as LIT_BAD, LitRatio, _loader

    from nanreplay.integrations.lightning import NanReplayCallback

    mlflow, uri = mlflow_store
    tb = TensorBoardLogger(str(tmp_path / "tb"), name="lit", version=0)
    wb = WandbLogger(project="nanreplay-test", save_dir=str(tmp_path / "wb"), offline=True)
    ml = MLFlowLogger(experiment_name="lit", tracking_uri=uri)
    csv = CSVLogger(str(tmp_path / "csv"))  # keeps no verdict: left out, no error
    cb = NanReplayCallback(out_dir=tmp_path / "bundles", embed_program=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=[tb, wb, ml, csv], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], log_every_n_steps=1)
    trainer.fit(LitRatio(lr=0.05), _loader())
    wb.experiment.finish()
    diag = cb.recorder.last_diagnosis
    assert cb.recorder.nonfinite_steps == [LIT_BAD] and diag["phase"] == "forward"
    texts, scalars = _tb_events(tmp_path / "tb" / "lit" / "version_0")
    assert scalars["nanreplay/nonfinite_step"] == [(LIT_BAD, float(LIT_BAD))]
    assert texts["nanreplay/nonfinite/text_summary"][0][1].startswith(inert_markdown(diag["summary"]))
    _, summary, artifacts = _wandb_view(tmp_path / "wb")
    assert summary["nanreplay/nonfinite"] == inert_markdown(diag["summary"]) and summary["nanreplay/module"] == "net.norm"
    assert artifacts and artifacts[0][0] == f"nanreplay-step{LIT_BAD}" and cb.recorder.bundles[0].name in artifacts[0][2]
    _, metrics, tags, files = _mlflow_view(mlflow, uri, ml.run_id)
    assert metrics["nanreplay.nonfinite_step"] == LIT_BAD and tags["nanreplay.phase"] == "forward"
    assert f"nanreplay/{cb.recorder.bundles[0].name}" in files


@pytest.mark.slow
def test_the_hf_trainer_logs_the_verdict_to_its_report_to(tmp_path, wandb_offline, mlflow_store, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from test_transformers import ACCUM, BAD_STEP as HF_BAD, MICRO, Tokens, _config

    from nanreplay.integrations.transformers import NanReplayCallback

    mlflow, uri = mlflow_store
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    monkeypatch.setenv("WANDB_PROJECT", "nanreplay-test")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    cb = NanReplayCallback(out_dir=tmp_path / "bundles", diagnose=False, embed_program=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=6,
        learning_rate=1e-3, report_to=["tensorboard", "wandb", "mlflow"], save_strategy="no", logging_steps=1,
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    wandb_offline.finish()  # the Trainer leaves its W&B run open: close it so that its file is complete
    assert cb.recorder.nonfinite_steps == [HF_BAD]
    bundle = cb.recorder.bundles[0]
    texts, scalars = _tb_events(tmp_path / "tb")
    assert scalars["nanreplay/nonfinite_step"] == [(HF_BAD, float(HF_BAD))]
    text = texts["nanreplay/nonfinite/text_summary"][0][1]
    assert text.startswith("non-finite ") and f" at step {HF_BAD}; not diagnosed yet: \\`nanreplay replay " in text  # diagnose=False
    _, summary, artifacts = _wandb_view(tmp_path / "wb")
    assert summary["nanreplay/bundle"] == inert_markdown(bundle.resolve()) and artifacts[0][2] == [bundle.name]
    client = mlflow.MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("hf").experiment_id])
    _, metrics, tags, files = _mlflow_view(mlflow, uri, run.info.run_id)
    assert metrics["nanreplay.nonfinite_step"] == HF_BAD and files == sorted([f"nanreplay/{bundle.name}", f"nanreplay/nanreplay-step{HF_BAD}.md"])


def test_a_malformed_stored_diagnosis_is_logged_without_trusting_its_shape(tmp_path, caplog):
    """A bundle is untrusted input: a stored diagnosis of any shape becomes text and tags, never an
    exception (and a missing bundle file is named, not copied)."""
    meta = {"failing_step": 7, "diagnosis": {"summary": 12, "phase": {"a": 1}, "classification": "oops", "origin": 5,
                                             "reproduction": [1], "chain": "x"}}
    ev = event_from_meta(tmp_path / "gone.h5", meta)
    assert (ev.kind, ev.step, ev.sentence) == ("nonfinite", 7, "12")
    assert ev.tags == {"event": "nonfinite", "phase": "{'a': 1}", "bundle": str(tmp_path / "gone.h5")}
    seen = Collect()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        Trackers(seen).emit(ev)
    assert seen.events == [ev] and not any(n.endswith(".h5") for n in seen.files[0])
    assert "gone.h5 cannot be read for the trackers" in caplog.text


# -- a hostile bundle's strings -------------------------------------------------------------------
#: what a stranger's bundle stores in its diagnosis to act in a tracker's page
HOSTILE = ("NaN ![x](http://evil.example/pixel.png) [click](javascript:alert(1)) <img src=x onerror=\"alert(1)\"> "
           "<http://evil.example/> `code` *bold* \u200bzero\u202eright\x1b[2J")


def _rendered_markup(html: str) -> list[str]:
    """The tags of ``html`` other than the paragraph and list markup plain text renders to."""
    import re

    return [t for t in re.findall(r"<\s*/?\s*([a-zA-Z]+)", html) if t.lower() not in ("p", "ul", "li")]


def test_text_sent_to_trackers_is_escaped_for_markdown_and_html(tmp_path, diagnosed_bundle, monkeypatch):
    """A bundle whose stored diagnosis holds a Markdown image, a javascript: link and an <img> tag:
    `nanreplay log --to tensorboard` writes it, TensorBoard's own renderer turns it into text only;
    the strings W&B and MLflow get are the same escaped text (no image, no link, no markup, no
    control or invisible character)."""
    pytest.importorskip("tensorboard")
    from tensorboard import plugin_util

    from attacks.make_attacks import read_manifest, write_manifest
    from nanreplay.capture.trackers import MlflowTracker, WandbTracker, event_from_meta

    bundle, diag = diagnosed_bundle
    hostile = tmp_path / bundle.name
    hostile.write_bytes(bundle.read_bytes())
    m = read_manifest(hostile)
    stored = m["meta"]["diagnosis"]
    stored["summary"] = HOSTILE
    stored["classification"]["detail"] = HOSTILE
    stored["origin"]["module"] = "[m](http://evil.example/)"
    write_manifest(hostile, m)
    monkeypatch.setenv("NANREPLAY_HOME", str(tmp_path / "home"))  # a stranger's bundle
    res = CliRunner().invoke(main, ["log", str(hostile), "--to", f"tensorboard:{tmp_path / 'tb'}"])
    assert res.exit_code == 0, res.output
    text = _tb_events(tmp_path / "tb")[0]["nanreplay/nonfinite/text_summary"][0][1]
    html = plugin_util.markdown_to_safe_html(text)
    assert _rendered_markup(html) == [] and "evil.example" in html, html  # the payloads show as text
    assert "![x](http://evil.example/pixel.png)" in html and "\\u200bzero\\u202eright\\x1b[2J" in html

    sent: list[str] = []

    class Box:
        def __init__(self):
            self.summary = self

        def update(self, d):
            sent.extend(str(v) for v in d.values())

        def log(self, d):
            pass

        def set_tag(self, run_id, key, value):
            sent.append(value)

        def log_metric(self, *a, **k):
            pass

        def log_text(self, run_id, text, name):
            sent.append(text)

    event = event_from_meta(hostile, dict(open_bundle(hostile).meta))
    WandbTracker(Box()).log(event, [])
    MlflowTracker(Box(), run_id="r").log(event, [])
    assert len(sent) > 6
    for s in sent:
        assert _rendered_markup(plugin_util.markdown_to_safe_html(s)) == [], s
        assert not any(c in s for c in "\x1b\u200b\u202e<>") and "](" not in s.replace("\\](", ""), s

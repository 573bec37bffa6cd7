"""What the early warning costs at the steps of a long episode, this checkout against another revision.

Usage::

    python bench/episode_cost.py --against f5fb705              # 40,000 steps each
    python bench/episode_cost.py --against HEAD~1 --steps 30000

Method. The ``small`` model (``bench/models.py``) trains with AdamW (lr 1e-3) on 64 fixed
batches, under this checkout's Recorder and, on a second copy, under revision REV's (loaded as in
``bench/hostcost.py``), default options (``on_spike="warn"``), the two loops interleaved step by
step. The model memorises its batches; after about 25,000 steps its loss leaves the floor and
climbs by 30x at a time (AdamW's late instability), and from then on most steps are out of band:
the early warning's episodes last hundreds of steps. Each Recorder's ``SpikeWatch._alarm`` (the
work an out-of-band step adds, inside the batched digest of finite steps) is timed with
``time.perf_counter``; the figure is its total over the run divided by the number of out-of-band
steps (microseconds per such step), with the number of episodes (one log line each).
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import hostcost  # noqa: E402  (bench/hostcost.py: another revision's package beside this one)
import models  # noqa: E402  (bench/models.py)
import overhead  # noqa: E402  (bench/overhead.py: the training step it times)


def timed_alarms(watch_cls: type, counts: collections.Counter) -> None:
    """Wrap ``watch_cls._alarm`` (a revision's ``SpikeWatch``) to add its calls, new episodes and
    microseconds to ``counts``."""
    original = watch_cls._alarm

    def alarm(self, step, rows, *args, **kwargs):  # noqa: ANN001, ANN202 - the wrapped method's own signature
        counts["out-of-band steps"] += 1
        counts["episodes"] += bool(self.early.new_episode)
        t0 = time.perf_counter()
        try:
            return original(self, step, rows, *args, **kwargs)
        finally:
            counts["us"] += (time.perf_counter() - t0) * 1e6

    watch_cls._alarm = alarm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the git revision to compare with (e.g. a commit or HEAD~1)")
    p.add_argument("--steps", type=int, default=40000, help="training steps of each loop")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("nanreplay").setLevel(logging.ERROR)  # one warning per episode, from both Recorders
    logging.getLogger(hostcost.OTHER).setLevel(logging.ERROR)
    from nanreplay import Recorder
    from nanreplay.capture.early import SpikeWatch

    factory, make_batch, loss_fn = models.spec("small")
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch(gen, cpu) for _ in range(64)]
    counts = {"this": collections.Counter(), "other": collections.Counter()}
    with tempfile.TemporaryDirectory() as tmp:
        other = hostcost.load_other(args.against, Path(tmp) / "pkg")
        timed_alarms(SpikeWatch, counts["this"])
        timed_alarms(sys.modules[hostcost.OTHER + ".capture.early"].SpikeWatch, counts["other"])
        loops = []
        for cls in (Recorder, other):
            torch.manual_seed(0)
            model = factory()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loops.append((model, opt, cls(model, opt, out_dir=tmp)))
        for i in range(args.steps):
            for model, opt, rec in loops:
                overhead._timed_step(model, opt, loss_fn, batches[i % len(batches)], cpu, rec)
        for _, _, rec in loops:
            rec.close()
    for name, label in (("other", args.against), ("this", "this checkout")):
        c = counts[name]
        per = c["us"] / c["out-of-band steps"] if c["out-of-band steps"] else float("nan")
        print(f"{label}: {c['out-of-band steps']} out-of-band steps in {c['episodes']} episodes over {args.steps} steps; "
              f"{per:.1f} µs per out-of-band step")
    print(f"(command: python bench/episode_cost.py --against {args.against} --steps {args.steps})")


if __name__ == "__main__":
    main()

"""Regenerate docs/report.png, the README's picture of the HTML report: run the built-in example
(examples/digits_nan.py), write its report with ``nanreplay report``, open it in headless
Chromium and save the top of the page.

    python docs/make_screenshot.py [--out docs/report.png] [--height 2200]

Needs the test extra (matplotlib, selenium, scikit-learn) and Chromium with its driver
(``apt-get install -y chromium chromium-driver``). Runs from the repository root, so the report
shows the example's path as the README's main job does (``examples/digits_nan.py``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import load_page, missing_reason  # noqa: E402  (tests/browser.py)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "report.png", help="the PNG to write")
    ap.add_argument("--height", type=int, default=2200, help="CSS pixels of the page to keep, from the top")
    args = ap.parse_args(argv)
    why = missing_reason()
    if why:
        print(f"cannot take the screenshot: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nanreplay-docs-") as tmp:
        run = Path(tmp) / "digits"
        subprocess.run([sys.executable, "examples/digits_nan.py", "--out-dir", str(run)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        (bundle,) = run.glob("nanreplay-step*.h5")
        html = run / "report.html"
        subprocess.run([sys.executable, "-m", "nanreplay.cli", "report", str(bundle), "-o", str(html)], cwd=ROOT, check=True)
        shot = Path(tmp) / "report.png"
        page = load_page(html, screenshot=shot, clip_height=args.height)
        if page.console:
            print(f"the page logged to the console: {page.console}", file=sys.stderr)
            return 1
        from PIL import Image

        # 256 colours keep the PNG small; the page is flat colours and anti-aliased text
        Image.open(shot).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

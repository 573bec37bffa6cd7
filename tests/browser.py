"""Headless Chromium for the HTML report tests and ``docs/make_screenshot.py``, driven with
Selenium through Debian's ``chromium-driver``.

Why Selenium and the distribution's driver: ``chromedriver`` from the ``chromium-driver``
package is built from the same source as the ``chromium`` package, so their versions always
match; Playwright drives the browser build it downloads (``playwright install``, impossible
offline) and supports a system Chromium only on a best-effort basis.

The browser runs with every background service off and a fresh profile, so it contacts no host
by itself; the host resolver maps every name to nothing, so a page that tried the network would
fail (and the performance log records the attempt, which the test asserts never happens).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND",
    "--hide-scrollbars", "--force-device-scale-factor=1",
)


def chromium_paths() -> tuple[Optional[str], Optional[str]]:
    """(chromium binary, chromedriver binary), each ``None`` when not installed."""
    browser = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser")) if p and Path(p).exists()), None)
    driver = next((p for p in (shutil.which("chromedriver"), "/usr/bin/chromedriver") if p and Path(p).exists()), None)
    return browser, driver


def missing_reason() -> Optional[str]:
    """Why the browser tests cannot run here, or ``None`` when they can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    browser, driver = chromium_paths()
    if browser is None or driver is None:
        return "Chromium is not installed (apt-get install -y chromium chromium-driver; .ci/run does this)"
    return None


@dataclass
class PageLoad:
    """What the browser saw loading one page."""

    console: list[dict]                       # console messages (level, message)
    requests: list[dict]                      # every request the browser made while loading: {url, document} (the requesting page)
    svgs: list[dict]                          # per <svg class="plot">: data-plot, width/height attributes, rendered box, element count
    text: str                                 # the page's visible text
    summary: str                              # the text of #summary
    screenshot: Optional[Path] = None
    extra: dict[str, Any] = field(default_factory=dict)


_SVG_JS = """
return Array.from(document.querySelectorAll('svg.plot')).map(s => {
  const r = s.getBoundingClientRect();
  return {plot: s.getAttribute('data-plot'), width: s.getAttribute('width'), height: s.getAttribute('height'),
          box: [r.x + window.scrollX, r.y + window.scrollY, r.width, r.height], elements: s.querySelectorAll('*').length,
          paths: s.querySelectorAll('path').length};
});
"""


def load_page(html: Path, *, screenshot: Optional[Path] = None, width: int = 1400, full_page: bool = True, clip_height: Optional[int] = None) -> PageLoad:
    """Open ``html`` (a local file) in headless Chromium and report what happened.

    Args:
        html: the page.
        screenshot: where to write a PNG of the page (``full_page``: the whole page; else the
            window), cut to ``clip_height`` CSS pixels when given.
        width: the window width in CSS pixels.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium_paths()
    profile = tempfile.mkdtemp(prefix="nanreplay-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for f in CHROMIUM_FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.add_argument(f"--window-size={width},1000")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    try:
        drv.get(html.resolve().as_uri())
        console = [{"level": e["level"], "message": e["message"]} for e in drv.get_log("browser")]
        requests = []
        for e in drv.get_log("performance"):
            msg = json.loads(e["message"])["message"]
            if msg.get("method") == "Network.requestWillBeSent":
                requests.append({"url": msg["params"]["request"]["url"], "document": msg["params"].get("documentURL")})
        svgs = drv.execute_script(_SVG_JS)
        text = drv.execute_script("return document.body.innerText")
        summary = drv.execute_script("const e = document.getElementById('summary'); return e ? e.textContent : ''")
        shot = None
        if screenshot is not None:
            h = int(drv.execute_script("return document.documentElement.scrollHeight")) if full_page else 1000
            if clip_height:
                h = min(h, clip_height)
            import base64

            data = drv.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": h, "scale": 1},
            })["data"]
            screenshot.write_bytes(base64.b64decode(data))
            shot = screenshot
        return PageLoad(console=console, requests=requests, svgs=svgs, text=text, summary=summary, screenshot=shot)
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)

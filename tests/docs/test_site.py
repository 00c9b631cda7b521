"""The site builds strictly, and every mermaid diagram of the fully async page renders (headless Chromium).

The build needs the `docs` extra (part of `test`); the rendering test needs Chromium (`.ci/run` installs
Debian's `chromium` when it can) and skips, with the reason shown, without it.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs._docs import DOCS, ROOT, fenced_blocks

FULLY_ASYNC = DOCS / "guide" / "fully-async.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if not _importable(m)]
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): pip install -e .[docs]")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.timeout(180)
def test_the_site_builds_strictly(site: Path) -> None:
    page = (site / "guide" / "fully-async" / "index.html").read_text(encoding="utf-8")
    assert page.count('class="mermaid"') == len(
        fenced_blocks(FULLY_ASYNC.read_text(encoding="utf-8"), "mermaid")
    )
    assert "javascripts/vendor/mermaid-" in page  # the vendored copy: the site renders offline
    assert (site / "reference" / "flags" / "index.html").is_file()


# Opens every shadow root (material renders each diagram into a closed one), then reports what
# rendered into the light DOM, where --dump-dom sees it.
PROBE_HEAD = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(String(e.message)));
window.addEventListener("unhandledrejection", e => window.__errors.push(String(e.reason)));
const __attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return __attach.call(this, {...init, mode: "open"}); };
</script>"""
PROBE_TAIL = """<script>
(function poll(n) {
  const hosts = [...document.querySelectorAll("div.mermaid")];
  const pending = document.querySelectorAll("pre.mermaid").length;
  const done = hosts.filter(h => h.shadowRoot && h.shadowRoot.querySelector("svg"));
  if ((pending === 0 && done.length === hosts.length && hosts.length) || n > 100) {
    const report = {
      pending, hosts: hosts.length, svgs: done.length, errors: window.__errors,
      roles: done.map(h => h.shadowRoot.querySelector("svg").getAttribute("aria-roledescription")),
      bad: done.filter(h => /Syntax error/.test(h.shadowRoot.querySelector("svg").textContent)).length,
      mermaid: typeof mermaid === "undefined" ? null : "loaded",
    };
    const pre = document.createElement("pre");
    pre.id = "mermaid-report";
    pre.textContent = JSON.stringify(report);
    document.body.appendChild(pre);
  } else {
    setTimeout(() => poll(n + 1), 100);
  }
})(0);
</script>"""


@pytest.fixture
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _chromium() -> str | None:
    return next((p for n in ("chromium", "chromium-browser") if (p := shutil.which(n))), None)


@pytest.mark.timeout(180)
def test_every_diagram_of_the_fully_async_page_renders(site: Path, served: str, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run does it where it can)")
    page = site / "guide" / "fully-async" / "index.html"
    probe = page.with_name("mermaid-probe.html")
    html = page.read_text(encoding="utf-8")
    html = html.replace("<head>", "<head>" + PROBE_HEAD, 1).replace("</body>", PROBE_TAIL + "</body>", 1)
    probe.write_text(html, encoding="utf-8")
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=30000",
            "--dump-dom",
            f"{served}/guide/fully-async/mermaid-probe.html",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    m = re.search(r'<pre id="mermaid-report">(.*?)</pre>', proc.stdout)
    assert m, f"no report (rc {proc.returncode}): {proc.stderr[-2000:]}"
    report = json.loads(m.group(1).replace("&quot;", '"'))
    expected = len(fenced_blocks(FULLY_ASYNC.read_text(encoding="utf-8"), "mermaid"))
    assert report["mermaid"] == "loaded", report
    assert report == {**report, "pending": 0, "hosts": expected, "svgs": expected, "bad": 0}, report
    assert "error" not in report["roles"], report
    assert not report["errors"], report

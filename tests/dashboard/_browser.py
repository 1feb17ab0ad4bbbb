"""A real headless Chromium driven over the DevTools protocol (no Selenium).

Streamlit renders its pages in the browser from messages on a websocket, so a page
is only "loaded" once the app has run: :meth:`Chromium.load` navigates, then polls
the rendered text until the app is idle and the text has stopped changing (and
contains what the caller waits for), and returns it with the DOM. :meth:`screenshot`
captures the whole page: Streamlit scrolls inside its main section, so the viewport
is first made as tall as that section.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

WIDTH, HEIGHT = 1400, 1000
SAVED: list[Path] = []
"""Screenshots taken in this test session (listed at the end of the run)."""
_RUNNING_JS = (
    '!!document.querySelector(\'[data-testid="stStatusWidget"] button, '
    '[data-testid="stSkeleton"]\')'
)


class BrowserError(RuntimeError):
    """Chromium did not start, or a page did not settle in time."""


@dataclass
class Loaded:
    """A page after the app rendered it."""

    url: str
    text: str
    """``document.body.innerText``."""
    html: str
    exceptions: list[str]
    """Text of every Streamlit exception box on the page."""
    seconds: float


class Chromium:
    """``chromium --headless=new`` with a DevTools websocket to its first page."""

    def __init__(
        self, binary: str = "chromium", *, width: int = WIDTH, height: int = HEIGHT
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise BrowserError(f"{binary} is not installed")
        self.width, self.height = width, height
        self._profile = Path(tempfile.mkdtemp(prefix="kvscope-chromium-"))
        self.proc = subprocess.Popen(
            [
                path,
                "--headless=new",
                "--disable-gpu",
                "--no-sandbox",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--disable-dev-shm-usage",
                f"--window-size={width},{height}",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection | None = None
        self.log: list[str] = []
        self._id = 0
        try:
            port = self._devtools_port(30.0)
            self.ws = self._stack.enter_context(
                connect(self._page_ws(port), max_size=None, open_timeout=10)
            )
            self._call("Page.enable")
            self._call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, timeout_s: float) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                # Keep reading chromium's log so a full pipe never blocks it.
                threading.Thread(target=self._drain, daemon=True, name="chromium-stderr").start()
                return int(m.group(1))
        raise BrowserError("chromium did not open its DevTools port:\n" + "".join(seen[-20:]))

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            del self.log[:-200]

    @staticmethod
    def _page_ws(port: int) -> str:
        for _ in range(50):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = json.loads(r.read())
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.1)
        raise BrowserError("chromium has no page target")

    def _call(
        self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        assert self.ws is not None
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer in {timeout_s:.0f} s")
            msg = json.loads(self.ws.recv(timeout=left))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error']}")
                return dict(msg.get("result") or {})

    def eval(self, expression: str) -> Any:
        res = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in res:
            raise BrowserError(f"{expression[:60]}: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def text(self) -> str:
        """The page's rendered text now."""
        return str(self.eval("document.body ? document.body.innerText : ''") or "")

    def load(
        self,
        url: str,
        *,
        wait_for: Sequence[str] = (),
        timeout_s: float = 90.0,
        settle_s: float = 2.0,
    ) -> Loaded:
        """Open ``url`` and wait until the app is idle, its text contains every string
        of ``wait_for`` and has not changed for ``settle_s`` seconds."""
        self._call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
        )
        t0 = time.monotonic()
        self._call("Page.navigate", {"url": url})
        last, stable_since = "", time.monotonic()
        while True:
            time.sleep(0.5)
            text = self.text()
            running = bool(self.eval(_RUNNING_JS))
            if text != last:
                last, stable_since = text, time.monotonic()
            settled = time.monotonic() - stable_since >= settle_s
            if (
                settled
                and not running
                and "stApp"
                in str(
                    self.eval("document.querySelector('[data-testid=\"stApp\"]') ? 'stApp' : ''")
                )
                and all(w in text for w in wait_for)
            ):
                break
            if time.monotonic() - t0 > timeout_s:
                missing = [w for w in wait_for if w not in text]
                raise BrowserError(
                    f"{url} did not settle in {timeout_s:.0f} s (running "
                    f"{running}, missing {missing}); text so far:\n{text[:3000]}"
                )
        exceptions = self.eval(
            "Array.from(document.querySelectorAll("
            "'[data-testid=\"stException\"]')).map(e => e.innerText)"
        )
        html = str(self.eval("document.documentElement.outerHTML"))
        return Loaded(url, last, html, list(exceptions or []), time.monotonic() - t0)

    def drag(self, x0: float, y0: float, x1: float, y1: float, moves: int = 10) -> None:
        """Press the left button at (x0, y0), move to (x1, y1), release (viewport px)."""
        base = {"button": "left", "clickCount": 1}
        self._call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x0, "y": y0})
        self._call("Input.dispatchMouseEvent", {"type": "mousePressed", "x": x0, "y": y0, **base})
        for i in range(1, moves + 1):
            x, y = x0 + (x1 - x0) * i / moves, y0 + (y1 - y0) * i / moves
            self._call(
                "Input.dispatchMouseEvent",
                {"type": "mouseMoved", "x": x, "y": y, "button": "left", "buttons": 1},
            )
            time.sleep(0.03)
        self._call("Input.dispatchMouseEvent", {"type": "mouseReleased", "x": x1, "y": y1, **base})

    def wait_for(self, predicate_js: str, timeout_s: float = 60.0) -> Any:
        """Poll ``predicate_js`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.eval(predicate_js)
            if v:
                return v
            if time.monotonic() > deadline:
                raise BrowserError(f"not true after {timeout_s:.0f} s: {predicate_js[:80]}")
            time.sleep(0.5)

    def screenshot(self, path: Path) -> Path:
        """The whole page as PNG (the viewport grown to the main section's height)."""
        full = self.eval(
            "Math.max(...Array.from(document.querySelectorAll("
            '\'[data-testid="stMain"], [data-testid="stMainBlockContainer"], '
            "section.main')).map(e => e.scrollHeight), 0)"
        )
        height = int(min(max(self.height, int(full or 0) + 40), 12000))
        self._call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        time.sleep(1.5)  # charts re-layout to the new size
        data = self._call("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self._stack.close()
            self.ws = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Chromium's helper processes can still write to the profile for a moment after
        # the browser exits: remove it until it is gone (a leftover is not an error).
        for _ in range(20):
            shutil.rmtree(self._profile, ignore_errors=True)
            if not self._profile.exists():
                break
            time.sleep(0.1)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

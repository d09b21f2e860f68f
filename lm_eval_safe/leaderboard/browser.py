"""Headless Chromium driven over its DevTools pipe: the report checked as a browser renders it.

``--dump-dom`` shows a page after its scripts ran but cannot click; the DevTools protocol can.
Over ``--remote-debugging-pipe`` (commands on the browser's fd 3, replies on its fd 4, each a
JSON message ended by a NUL byte) it needs nothing beyond the standard library and Debian's
``chromium`` package: no driver binary, no websocket client.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The first Chromium on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class HeadlessPage:
    """One page of a headless Chromium: open a file, evaluate JavaScript, take a screenshot."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000, timeout: float = 60.0):
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="lm-eval-safe-chromium-")
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def wire() -> None:  # in the child: the protocol's fd 3 and 4
            # through fresh copies: a pipe end that already is fd 3 or 4 (a fresh process) would
            # make dup2 a no-op that keeps close-on-exec
            commands, replies = os.dup(commands_read), os.dup(replies_write)
            os.dup2(commands, 3)
            os.dup2(replies, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
            preexec_fn=wire,
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self._call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            page=True,
        )

    # -- protocol ---------------------------------------------------------------------------
    def _send(self, method: str, params: dict[str, Any], session: str | None) -> int:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise BrowserError("chromium stopped answering on its DevTools pipe")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise BrowserError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _call(self, method: str, params: dict[str, Any] | None = None, page: bool = False) -> Any:
        wanted = self._send(method, params or {}, self._session if page else None)
        while True:
            reply = self._receive()
            if reply.get("id") != wanted:
                continue  # an event
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error'].get('message')}")
            return reply["result"]

    # -- page -------------------------------------------------------------------------------
    def open(self, path: Path) -> None:
        """Load a file and wait until its scripts ran (``document.readyState == 'complete'``)."""
        self._call("Page.navigate", {"url": path.resolve().as_uri()}, page=True)
        deadline = time.monotonic() + self.timeout
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise BrowserError(f"{path} did not finish loading")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        """A JavaScript expression's value in the page (JSON-serialisable results)."""
        result = self._call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, page=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self._call("Page.captureScreenshot", params, page=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):  # it may be gone already
            self._call("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for fd in (self._commands, self._replies):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def __enter__(self) -> HeadlessPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A real headless browser for the tests: Debian's chromium, driven over the DevTools protocol.

Chromium listens on ``--remote-debugging-port=0`` and writes the port it picked, with its browser
endpoint's path, to ``DevToolsActivePort`` in its (fresh) profile directory. One WebSocket to that
endpoint (the ``websockets`` library the project already uses) carries the protocol's JSON
commands; a page is a target created and attached to in "flat" mode, its commands tagged with the
session id. Every wait is bounded, and the whole process group of chromium (its renderer, GPU and
utility processes) is stopped on exit, whatever happened.

See https://chromedevtools.github.io/devtools-protocol/ for the commands used here.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from websockets.sync.client import ClientConnection, connect

from somatize.cli.cluster import wait_for

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root, where chromium's sandbox will not start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]
WIDTH, HEIGHT = 1280, 760
"""The page's viewport, in CSS pixels (and the screenshot's size)."""


class BrowserError(Exception):
    """Chromium did not start, or answered a command with an error."""


class Page:
    """One tab, through the browser's DevTools WebSocket.

    Args:
        ws: the connection to the browser endpoint.
        timeout: seconds any one command may take.
    """

    def __init__(self, ws: ClientConnection, timeout: float) -> None:
        self._ws = ws
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._session: str | None = None

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one command (to the page once :meth:`open` attached one) and return its result;
        events arriving meanwhile are dropped (nothing here subscribes to any)."""
        command: dict[str, Any] = {"id": next(self._ids), "method": method, "params": params or {}}
        if self._session is not None:
            command["sessionId"] = self._session
        self._ws.send(orjson.dumps(command).decode())
        deadline = time.monotonic() + self._timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"{method}: no answer within {self._timeout:.0f}s")
            reply = orjson.loads(self._ws.recv(timeout=remaining))
            if reply.get("id") != command["id"]:
                continue
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            result: dict[str, Any] = reply["result"]
            return result

    def open(self, url: str) -> None:
        """Open a new tab of :data:`WIDTH` x :data:`HEIGHT` on ``url``."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attach = {"targetId": target, "flatten": True}
        self._session = self.call("Target.attachToTarget", attach)["sessionId"]
        self.resize(WIDTH, HEIGHT)
        navigated = self.call("Page.navigate", {"url": url})
        if navigated.get("errorText"):
            raise BrowserError(f"cannot open {url}: {navigated['errorText']}")

    def resize(self, width: int, height: int) -> None:
        """Make the viewport ``width`` x ``height`` CSS pixels (:meth:`open` makes it
        :data:`WIDTH` x :data:`HEIGHT`)."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page."""
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes."""
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])


@contextlib.contextmanager
def chromium(profile: Path, log: Path, timeout: float) -> Iterator[Page]:
    """A headless chromium with a fresh profile in ``profile`` (its output in ``log``); yields a
    :class:`Page` (call :meth:`Page.open` first). Every wait takes at most ``timeout`` seconds."""
    profile.mkdir(parents=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one below
        )
    try:
        port, path = wait_for(lambda: _devtools_address(proc, profile, log), timeout, "chromium")
        with connect(
            f"ws://127.0.0.1:{port}{path}",
            max_size=None,  # screenshots are one large message
            open_timeout=timeout,
            close_timeout=timeout,
            compression=None,
        ) as ws:
            yield Page(ws, timeout)
    finally:
        _stop(proc, timeout)


def _devtools_address(
    proc: subprocess.Popen[bytes], profile: Path, log: Path
) -> tuple[int, str] | None:
    """``(port, browser path)`` once chromium wrote ``DevToolsActivePort``; fails if it died."""
    if proc.poll() is not None:
        raise BrowserError(f"chromium exited with status {proc.returncode}; see {log}")
    with contextlib.suppress(FileNotFoundError):
        lines = (profile / "DevToolsActivePort").read_text().split()
        if len(lines) == 2 and lines[0].isdigit():  # it is written in one go, but be sure
            return int(lines[0]), lines[1]
    return None


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM to chromium's whole process group, SIGKILL if it is not gone in time."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):  # its children too, even if it went first
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)

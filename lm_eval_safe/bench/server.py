"""A real ``lm-eval-safe serve`` process on a free port, for the server's benchmark and tests:
started with the current interpreter, ready once ``/health`` answers, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``lm-eval-safe serve`` started with ``model_args`` and ``extra`` flags; ``url`` is its
    root, ``log`` what it printed (read after it stopped, or while it runs)."""

    def __init__(self, model_args: str, *extra: str, log_dir: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        command = [
            sys.executable, "-m", "lm_eval_safe.cli", "serve",
            "--model_args", model_args, "--port", str(self.port), *extra,
        ]  # fmt: skip
        environment = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **(env or {}))
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=environment)

    def wait_ready(self, timeout: float = 600.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not ready in {timeout} s:\n{self.log[-3000:]}")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, and the exit code once it exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()

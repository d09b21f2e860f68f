"""Plain-HTTP helpers for the server's tests (the process itself: lm_eval_safe.bench.server)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lm_eval_safe.bench.server import ServerProcess

__all__ = ["ServerProcess", "get", "metric", "post", "rss_kib"]


def post(url: str, body: Any, headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, Any]:
    """POST JSON (or ``raw`` bytes) with the standard library; (status, parsed body)."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, text.decode(errors="replace")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples (matching ``labels``) in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def stream_pieces(server: Any, path: str, body: dict[str, Any]) -> tuple[list[str], list[dict]]:
    """The text pieces of a streamed response, and every event's body."""
    status, events = None, []
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    status = reply.status
    for line in reply.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    conn.close()
    assert status == 200, events
    pieces = []
    for e in events:
        for choice in e["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            if piece:
                pieces.append(piece)
    return pieces, events


# -- same texts ---------------------------------------------------------------------------------

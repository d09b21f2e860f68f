"""``lm-eval-safe serve --model_args members=a,b[,option=value ...]``: load the ensemble as
``--model safe-ensemble`` would, then answer OpenAI API requests until SIGTERM or Ctrl-C.

Stopping (SIGTERM, SIGINT): the server stops accepting connections, lets the requests in flight
finish for up to ``--shutdown-timeout`` seconds, cancels the rest (their clients get a 503 or a
closed stream), and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from lm_eval_safe.errors import reporting_user_errors

logger = logging.getLogger("lm_eval_safe.serve")

API_KEY_ENV = "LM_EVAL_SAFE_API_KEY"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SERVER_PACKAGES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


DESCRIPTION = (
    "Serve a SAFE ensemble behind an OpenAI-compatible API (/v1/completions, "
    "/v1/chat/completions, /v1/models, /health, /metrics)."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lm-eval-safe serve", description=DESCRIPTION)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    """The server's options, on its own parser or on ``lm-eval-safe``'s ``serve`` subcommand."""
    p.add_argument(
        "--model_args",
        "--model-args",
        required=True,
        help="the members and options, as for lm_eval --model safe-ensemble "
        "(e.g. members=smollm2-135m,gemma3-270m,batch_size=8)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may send as 'model' (default: safe-ensemble and the members joined by '+')",
    )
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (default 8 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--log-prompts", action="store_true", help="log each request's prompt (off by default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))


@reporting_user_errors("lm-eval-safe serve")
def run(args: argparse.Namespace) -> None:
    """Start the server the parsed options describe; return once it has stopped. A bad option,
    member or library version ends the start-up in one line (the traceback:
    ``LM_EVAL_SAFE_TRACEBACK=1`` or ``--log-level debug``)."""
    missing = [pip for module, pip in SERVER_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        sys.exit(
            f"lm-eval-safe serve: {', '.join(missing)} not installed: pip install 'lm-eval-safe[serve]'"
        )
    if args.max_request_bytes < 1:
        sys.exit("lm-eval-safe serve: --max-request-bytes must be at least 1")
    logging.basicConfig(format="%(levelname)s %(asctime)s %(name)s: %(message)s", level=args.log_level.upper())
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None

    import uvicorn

    app = build(args.model_args, args.served_model_name, api_key, args.max_request_bytes, args.log_prompts)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who reaches it can use it (--api-key)", args.host)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    server = _server_class(uvicorn)(config)
    server.run()
    if not server.started:  # e.g. the port is taken: uvicorn said why
        sys.exit(1)


def _server_class(uvicorn: Any) -> type:
    class Server(uvicorn.Server):
        """uvicorn's server, exiting 0 after a graceful stop.

        uvicorn (0.29+) raises SIGTERM/SIGINT once more after its graceful shutdown, so the
        process dies of the signal (exit code -15); a server that finished its requests and
        stopped cleanly exits 0, as vLLM's does. The handlers are uvicorn's own ``handle_exit``.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def build(
    model_args: str, names: list[str] | None, api_key: str | None, max_body: int, log_prompts: bool
) -> object:
    """The ensemble loaded and wrapped in its ASGI app (FastAPI behind the gate)."""
    from lm_eval_safe import MODEL_NAME
    from lm_eval_safe.harness.model import SafeEnsembleLM
    from lm_eval_safe.model_args import parse_model_args
    from lm_eval_safe.scoring.loglikelihood import score_segments
    from lm_eval_safe.serve.app import ServerState, build_app
    from lm_eval_safe.serve.gate import Gate
    from lm_eval_safe.serve.metrics import Metrics
    from lm_eval_safe.serve.scheduler import Scheduler
    from lm_eval_safe.serve.translate import Translator

    raw = parse_model_args(model_args)
    logger.info("loading the members (the first start converts GGUF weights: a minute or two)")
    lm = SafeEnsembleLM.create_from_arg_obj(raw)
    rows = serving_rows(lm.options, raw, lm.members)
    joined = "+".join(m.name for m in lm.members)
    names = names or [MODEL_NAME, joined]
    scheduler = Scheduler(lm.decoder, rows)
    metrics = Metrics(names[0], scheduler.counts)
    scheduler.observer = metrics
    translator = Translator(lm.members, lm.drafter_index, lm.decoder, lm.options.max_gen_toks)
    info = lm.get_model_info()
    description = {
        "members": [m["name"] for m in info["members"]],
        "drafter": info["drafter"],
        "schedule": info["schedule"],
        "aggregator": info["aggregator"],
        "max_num_seqs": rows,
        "max_model_len": lm.drafter.max_length,
    }
    score = partial(score_segments, lm.members, lm.options)
    state = ServerState(scheduler, translator, metrics, names, description, score, log_prompts)
    logger.info("%s: %d rows decoded together at most", joined, rows)
    return Gate(build_app(state), api_key, max_body, metrics.on_http)


def serving_rows(options: Any, raw: dict[str, Any], members: Sequence[Any] = ()) -> int:
    """Rows decoded together: ``batch_size`` when given as a number, else ``max_batch_size``
    (default 64), at most what each engine's members hold at once beside a request's scoring
    (vLLM's request slots and llama.cpp's sequences, one kept free): continuous batching keeps
    the batch as full as the clients make it."""
    from lm_eval_safe.engines import serving_rows as engine_rows

    typed = raw.get("batch_size") not in (None, "") and options.batch_size != "auto"
    return engine_rows(options, members, max(1, int(options.batch_size)) if typed else None)

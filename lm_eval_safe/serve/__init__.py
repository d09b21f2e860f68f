"""``lm-eval-safe serve``: the ensemble behind an OpenAI-compatible HTTP server.

A second front door beside :class:`~lm_eval_safe.harness.model.SafeEnsembleLM`, not a second decoder:
the same members, options and :class:`~lm_eval_safe.decoder.loop.SafeDecoder`. The routes only
translate (:mod:`.app`, :mod:`.protocol`, :mod:`.translate`); a request's work (checks, answer,
stream, scores) is :mod:`.serving`'s; one thread decodes every request in one continuously
refilled batch (:mod:`.scheduler`); streamed text is what SAFE has settled (:mod:`.streaming`);
``/metrics`` speaks Prometheus (:mod:`.metrics`).

Import-light: FastAPI, uvicorn and prometheus-client load only when a server starts.
"""

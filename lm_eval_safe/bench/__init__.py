"""What the benchmark scripts in ``scripts/`` share, importable like the rest of the package.

* :mod:`.prompts`: benchmark prompts from the local data (the paper's math prompt, few-shot).
* :mod:`.eos`: members that never predict EOS, so every method generates the same length.
* :mod:`.memory`: peak and current RSS, live tensors, a probe sampling them mid-run.
* :mod:`.timing`: device synchronisation and timed calls (CUDA runs asynchronously).
* :mod:`.output`: formatting of table cells and the JSON reports.
* :mod:`.speed`, :mod:`.floor`, :mod:`.speed_report`: ``scripts/bench_speed.py``'s methods,
  its draft-then-verify floor, and the per-token ratios and table over their runs.

Nothing here is imported by the start-up hook; the modules that need torch import it.
"""

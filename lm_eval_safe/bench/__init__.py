"""The benchmarks: their commands (:mod:`.commands`, ``lm-eval-safe bench NAME``) and what they share.

* :mod:`.prompts`: benchmark prompts from the local data (the paper's math prompt, few-shot).
* :mod:`.eos`: members that never predict EOS, so every method generates the same length.
* :mod:`.memory`: peak and current RSS, live tensors, a probe sampling them mid-run.
* :mod:`.timing`: device synchronisation and timed calls (CUDA runs asynchronously).
* :mod:`.output`: formatting of table cells and the JSON reports.
* :mod:`.speed`, :mod:`.floor`, :mod:`.speed_report`: ``lm-eval-safe bench speed``'s methods,
  its draft-then-verify floor, and the per-token ratios and table over their runs.
* :mod:`.eval_runs`, :mod:`.eval_report`: ``lm-eval-safe bench eval``'s timed runs (wall times,
  the ensemble's measured floor: the drafter's run plus the verifiers reading its texts) and
  its tables.

Nothing here is imported by the start-up hook; the modules that need torch import it.
"""

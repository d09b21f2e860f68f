"""The leaderboard behind ``lm-eval-safe leaderboard``: members alone vs. ensembles on the paper's tasks.

Why a package and not the script alone: the numbers of a leaderboard (accuracy with its Wilson
interval, E/T, acceptance, tokens/s, wall time) are read from cached results by more than one
front end, and every front end must show the same numbers. The parts, from the bottom up:

* :mod:`~lm_eval_safe.leaderboard.configs`: which rows exist (members alone, the built-in
  ensembles, the paper's pairs and their reported numbers) and the model_args of each.
* :mod:`~lm_eval_safe.leaderboard.result_cache`: one JSON record per finished (configuration,
  task, limit), named by a hash of everything that changes its numbers, and the row
  (:class:`~lm_eval_safe.leaderboard.result_cache.Outcome`) read back from it.
* :mod:`~lm_eval_safe.leaderboard.report`: the computations over outcomes and their markdown
  table and plot; functions of results, not of a command line.
* :mod:`~lm_eval_safe.leaderboard.runner`: runs the missing cells through
  ``lm_eval.simple_evaluate`` (or one ``lm_eval`` process per cell) and caches each at once.

Nothing here is imported by the start-up hook; lm-eval and torch load only when a cell runs.
"""

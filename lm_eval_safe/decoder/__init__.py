"""The decoder: one loop for every schedule (docs/algorithm.md, The cycle).

``loop`` drives a request's cycles; ``schedules`` decides when to ensemble; ``member_runs`` keeps
each member's state in a request; ``batch_driver`` advances many requests in lock-step over
shared member batches (``overlap`` and ``draft_window`` shape its calls, ``latency`` models their
depth); ``stats`` and ``tracing`` report what the loop did.
"""

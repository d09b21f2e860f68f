"""``reference=authors``: the SAFE authors' code where it differs from the paper's rules
(docs/algorithm.md, The authors' code): its alignment, its UniTE and GaC, GaC's union."""

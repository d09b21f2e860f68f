"""Where lm-eval comes in: the registered ``safe-ensemble`` model, its requests, ``--use_cache``
identities and data-parallel collectives."""

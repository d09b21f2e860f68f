"""What happens at an ensemble point (docs/algorithm.md, Aggregators and Sharpening).

``aggregate`` holds the paper's aggregators over the union vocabulary; ``certified`` decides from
engine heads with interval bounds; ``sampling`` is the sampled path's rule; ``ensembler`` is the
one decision the loop asks for; ``authors/`` is the SAFE authors' code where it differs.
"""

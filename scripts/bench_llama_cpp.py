#!/usr/bin/env python3
"""``lm-eval-safe bench llama-cpp`` (this wrapper keeps older commands working; the code lives in the package)."""

import sys

from lm_eval_safe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "llama-cpp", *sys.argv[1:]]))

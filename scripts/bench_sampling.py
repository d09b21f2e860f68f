#!/usr/bin/env python3
"""``lm-eval-safe bench sampling`` (this wrapper keeps older commands working; the code lives in the package)."""

import sys

from lm_eval_safe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sampling", *sys.argv[1:]]))

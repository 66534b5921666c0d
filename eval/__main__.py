"""``python -m qmc_sampler.eval`` = ``qmc-eval``."""

import sys

from qmc_sampler.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())

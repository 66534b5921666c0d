"""`make run`: the main job (i.i.d. vs lattice pass@k on the embedded default model)."""

import sys


def main() -> int:
    print("qmc-sampler: the main job (pass@k of iid vs lattice on the default model) is not yet available;")
    print("`make test` runs the core's test suite.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks.attacks``: runs :func:`benchmarks.attacks.bench.main`."""

import sys

from benchmarks.attacks.bench import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks.faults``: runs :func:`benchmarks.faults.bench.main`."""

import sys

from benchmarks.faults.bench import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks.fleet``: runs :func:`benchmarks.fleet.bench.main`."""

from benchmarks.fleet.bench import main

if __name__ == "__main__":
    main()

"""``python -m benchmarks.federated``: runs :func:`benchmarks.federated.bench.main`."""

from benchmarks.federated.bench import main

if __name__ == "__main__":
    main()

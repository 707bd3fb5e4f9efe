"""``python -m benchmarks.slow_links``: runs :func:`benchmarks.slow_links.bench.main`."""

from benchmarks.slow_links.bench import main

if __name__ == "__main__":
    main()

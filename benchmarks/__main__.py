"""``python -m benchmarks``: every benchmark of the suite, one after the other.

Each module measures its figure next to a real anchor in the same run (see its docstring) and can
be run alone: ``python -m benchmarks.codec``, ``python -m benchmarks.daemon``.
"""

from __future__ import annotations

import importlib
import sys

SUITE = ("codec", "daemon", "roundtrip", "fleet", "data_parallel", "allreduce", "pipeline")


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(SUITE)
    unknown = sorted(set(names) - set(SUITE))
    if unknown:
        print(f"unknown benchmarks {unknown}; choose from {list(SUITE)}", file=sys.stderr)
        return 2
    for name in names:
        importlib.import_module(f"benchmarks.{name}").main()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

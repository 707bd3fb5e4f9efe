#!/usr/bin/env bash
# Flower's own virtualenv, for the Flower row of `python -m benchmarks.federated`:
#
#     benchmarks/federated/flower_env.sh [VENV]      # default: .flower-venv at the repository's root
#     python -m benchmarks.federated --flower-python .flower-venv/bin/python
#
# flwr[simulation] (Ray) is installed here, apart from the project's .venv, whose pins of rich and
# pycryptodome it would move. Every version is pinned by benchmarks/federated/flower-constraints.txt: flwr
# 1.42.0, Ray 2.55.1, and torch 2.13.0 exactly (the CPU build; an open range pulls a multi-GB
# CUDA build). About 1.4 GB on disk, mostly torch and Ray.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.flower-venv}"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/benchmarks/federated/flower-constraints.txt"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" \
    'flwr[simulation]==1.42.0' 'torch==2.13.0' 'numpy==2.4.6'
"$VENV/bin/python" -c 'import flwr, ray, torch; print("flwr", flwr.__version__, "ray", ray.__version__, "torch", torch.__version__)'
echo "Flower's Python: $VENV/bin/python"

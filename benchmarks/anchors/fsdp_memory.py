"""The anchor of :mod:`benchmarks.sharded_memory`: torch's own ``fully_shard`` in N plain
processes over gloo, on the same model, optimizer and batches, without a coordinator, a
worker or a daemon: what FSDP2 itself holds per rank while it trains.

Each rank builds the L × Linear(W, W) model whole (seeded), shards every layer and then the
whole as the daemons do (:class:`engine.data_parallel.sharding.ShardedRun`'s default units), makes
Adam over the shards, and trains the same global batches (``rows`` rows, ``batch`` a step, each rank
its ``batch / N`` rows of each). Its peak resident memory is read from ``VmHWM`` — reset once the
model is sharded (``/proc/self/clear_refs``), so the whole model it was built from does not
count, as the daemons' loading phase is apart from their training — over its resident memory
before the model was built (its Python, torch and gloo), as the daemons' figure is over their
idle memory.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

__all__ = ["peaks"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _high_water() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rank(rank: int, n: int, port: int, sizes: tuple[int, int, int, int], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    width, layers, rows, batch = sizes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)
    base = _resident()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    y = torch.randint(0, width, (rows,), generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the training alone
    for start in range(0, rows, batch):
        local = slice(start + rank * batch // n, start + (rank + 1) * batch // n)
        loss = torch.nn.functional.cross_entropy(model(x[local]), y[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    Path(out, str(rank)).write_text(str(_high_water() - base))
    dist.barrier()  # (the group is left to the process's exit: engine.group_member says why)


def peaks(n: int, width: int, layers: int, rows: int, batch: int) -> list[int]:
    """Each rank's peak resident bytes while it trains (module docstring), rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="fsdp-anchor-") as out:
        mp.start_processes(
            _rank, args=(n, port, (width, layers, rows, batch), out), nprocs=n, start_method="spawn"
        )
        return [int(Path(out, str(r)).read_text()) for r in range(n)]

"""protocol.asyncio.memory: freed buffers are reused, not faulted in again.

Each case runs in a fresh interpreter: malloc settings are process-wide, and the effect shows in
the page faults of that process alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.utils import timeout_unit

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, resource, sys
from protocol.asyncio.memory import keep_freed_memory, map_tensor_blocks
settings = {"keep": keep_freed_memory, "map": map_tensor_blocks}.get(sys.argv[1])
applied = settings() if settings is not None else None

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        # What a WebSocket frame does: several same-size buffers alive at once, then freed.
        blocks = [bytearray(4 << 20) for _ in range(3)]  # malloc + memset: every page written
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()  # the first round faults the memory in either way
print(json.dumps({"applied": applied, "faults": faults()}))
"""


def run(mode: str) -> dict[str, int | bool | None]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30 * timeout_unit(),
        check=True,
    )
    result: dict[str, int | bool | None] = json.loads(out.stdout)
    return result


def test_freed_buffers_are_reused_without_page_faults() -> None:
    default, kept = run("default"), run("keep")
    assert kept["applied"] is True
    # 10 rounds of 12 MiB: glibc's defaults give most of it back to the kernel each round
    # (~3,000 faults of 4 KiB a round); kept, the same memory serves every round.
    assert isinstance(default["faults"], int) and default["faults"] > 5_000
    assert isinstance(kept["faults"], int) and kept["faults"] < 500


def test_a_sharded_daemons_blocks_are_mapped_and_given_back_whole() -> None:
    kept, mapped = run("keep"), run("map")
    assert mapped["applied"] is True
    # Blocks of 1 MiB and more are mapped anew and unmapped once freed (every round faults its
    # 12 MiB in again: ~3,000 faults of 4 KiB), never kept in the heap to fragment it.
    assert isinstance(mapped["faults"], int) and mapped["faults"] > 5_000
    assert isinstance(kept["faults"], int) and kept["faults"] < 500

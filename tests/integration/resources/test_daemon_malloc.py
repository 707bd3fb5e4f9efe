"""Which ``malloc`` a job's filter daemon runs with (``somatize-worker --daemon-malloc``).

A real coordinator and ``somatize-worker`` run a filter that reports the shared libraries mapped
in its own daemon: with the default (``auto``) on a machine that has tcmalloc (``make test``
installs Debian's ``libtcmalloc-minimal4``) every daemon has it, forked from the fork server or
started anew in a bubblewrap sandbox, and it allocates from it (the C library's ``malloc`` is
not the one a new block comes from); ``--daemon-malloc glibc`` leaves it out.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

import somatize as sz
from tests.integration.cluster import cluster
from tests.utils import UNIT

pytestmark = pytest.mark.integration


class Allocator(sz.Filter):
    """Its state: the tcmalloc libraries mapped in the daemon, and whether ``malloc`` resolves
    to the C library's own."""

    def fit(self, x, y=None):
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if "tcmalloc" in line}
        process = ctypes.CDLL(None)  # the symbols as the dynamic linker resolved them
        libc = ctypes.CDLL("libc.so.6")
        glibc_malloc = (
            ctypes.cast(process.malloc, ctypes.c_void_p).value
            == ctypes.cast(libc.malloc, ctypes.c_void_p).value
        )
        return {
            "mapped": sorted(os.path.basename(path) for path in mapped),
            "glibc_malloc": glibc_malloc,
            "preload": os.environ.get("LD_PRELOAD"),
        }

    def forward(self, x, state):
        return x


def _daemon_allocator(tmp_path, args, sandbox="none") -> dict:
    with cluster(tmp_path, {}, sandbox=sandbox) as c:
        c.start_worker("w1", args=args)
        with c.client() as client:
            job = client.submit(sz.Graph([Allocator().named("malloc")]), np.zeros((2, 1)))
            return job.result(timeout=120 * UNIT).states["malloc"]


@pytest.mark.parametrize("sandbox", ["none", "bwrap"], ids=["forked", "sandboxed"])
def test_a_daemon_allocates_with_tcmalloc_by_default(tmp_path, sandbox):
    state = _daemon_allocator(tmp_path, [], sandbox)
    assert [name for name in state["mapped"] if name.startswith("libtcmalloc_minimal.so")], state
    assert not state["glibc_malloc"]
    assert state["preload"] == "libtcmalloc_minimal.so.4"


def test_daemon_malloc_glibc_keeps_the_c_librarys_own(tmp_path):
    state = _daemon_allocator(tmp_path, ["--daemon-malloc", "glibc"])
    assert state == {"mapped": [], "glibc_malloc": True, "preload": None}


class HeapLimit(sz.Filter):
    """Its state: tcmalloc's heap limit in the daemon, and what its memory was as it fitted."""

    def fit(self, x, y=None):
        process = ctypes.CDLL(None)
        get = process.MallocExtension_GetNumericProperty
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]

        def read(name: bytes) -> int:
            value = ctypes.c_size_t()
            assert get(name, ctypes.byref(value))
            return value.value

        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        heap = read(b"generic.heap_size") - read(b"tcmalloc.pageheap_unmapped_bytes")
        return {
            "limit_mib": read(b"tcmalloc.heap_limit_mb"),
            "outside_mib": (resident - heap) >> 20,
        }

    def forward(self, x, state):
        return x


class Hog(sz.Filter):
    """Fits by filling a tensor of 1 GiB."""

    def fit(self, x, y=None):
        import torch

        return {"sum": float(torch.ones(1 << 28).sum())}

    def forward(self, x, state):
        return x


def test_a_job_under_max_job_memory_holds_tcmallocs_heap_to_what_the_limit_leaves(tmp_path):
    with cluster(tmp_path, {}) as c:
        c.start_worker("w1", args=["--max-job-memory", "900M"])
        with c.client() as client:
            job = client.submit(sz.Graph([HeapLimit().named("heap")]), np.zeros((2, 1)))
            state = job.result(timeout=120 * UNIT).states["heap"]
            # The libraries, Python's arenas and the shared regions lie outside the heap.
            assert 100 < state["outside_mib"] < 600, state
            assert abs(state["limit_mib"] - (900 - state["outside_mib"])) <= 16, state

            hog = client.submit(sz.Graph([Hog().named("hog")]), np.zeros((2, 1)))
            with pytest.raises(sz.JobFailed) as failed:
                hog.result(timeout=120 * UNIT)
            # The allocation is refused and the daemon answers: not killed by the watchdog.
            assert failed.value.code == "resource_limit"
            assert "could not allocate within --max-job-memory 900 MiB" in failed.value.message
            assert "tcmalloc's heap was held to" in failed.value.message

            again = client.submit(sz.Graph([HeapLimit().named("heap")]), np.zeros((2, 1)))
            assert again.result(timeout=120 * UNIT).states["heap"]["limit_mib"] > 0

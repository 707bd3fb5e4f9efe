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

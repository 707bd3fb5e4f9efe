"""``--daemon-malloc``: which allocator each level gets, and what a daemon's environment holds."""

from __future__ import annotations

import pytest

from worker.daemon.allocator import GLIBC, Allocator, HeapBound, choose, heap_share


def _found(name: str) -> str | None:
    return "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None


def _missing(name: str) -> str | None:
    return None


@pytest.mark.parametrize("level", ["auto", "tcmalloc"])
def test_tcmalloc_is_taken_where_it_is_installed(level):
    assert choose(level, _found) == Allocator("tcmalloc", "libtcmalloc_minimal.so.4")


def test_auto_falls_back_to_glibc_where_tcmalloc_is_missing_and_glibc_is_glibc():
    assert choose("auto", _missing) is GLIBC
    assert choose("glibc", _found) is GLIBC


def test_asking_for_a_missing_tcmalloc_or_an_unknown_level_says_what_to_do():
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        choose("tcmalloc", _missing)
    with pytest.raises(ValueError, match="one of auto, tcmalloc, glibc, not 'jemalloc'"):
        choose("jemalloc", _found)


def test_the_environment_preloads_tcmalloc_before_an_operators_own_preload():
    tcmalloc = Allocator("tcmalloc", "libtcmalloc_minimal.so.4")
    assert tcmalloc.environment()["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert tcmalloc.environment("/opt/trace.so")["LD_PRELOAD"] == (
        "libtcmalloc_minimal.so.4 /opt/trace.so"
    )
    assert int(tcmalloc.environment()["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert "SOMATIZE_MAX_JOB_MEMORY" not in tcmalloc.environment()
    assert tcmalloc.environment(None, 900 << 20)["SOMATIZE_MAX_JOB_MEMORY"] == str(900 << 20)
    assert GLIBC.environment("/opt/trace.so", 900 << 20) == {}


def test_the_heap_gets_what_the_limit_leaves_beside_the_rest_of_the_memory():
    mib = 1 << 20
    assert heap_share(900 * mib, resident=400 * mib, heap_resident=150 * mib) == 650 * mib
    assert heap_share(900 * mib, resident=100 * mib, heap_resident=150 * mib) == 900 * mib


def test_only_an_allocation_the_heap_limit_refused_is_a_resource_limit():
    bound = HeapBound.from_environment({"SOMATIZE_MAX_JOB_MEMORY": str(900 << 20)})
    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert bound.out_of_memory(refused, "fit") is None  # no limit was set: not its doing
    bound.heap_limit = 700 << 20
    info = bound.out_of_memory(refused, "fit")
    assert info is not None and info.code == "resource_limit"
    assert info.message.startswith("fit could not allocate within --max-job-memory 900 MiB")
    assert "held to 700 MiB" in info.message and "1073741824 bytes" in info.message
    assert bound.out_of_memory(MemoryError(), "fit") is not None
    assert bound.out_of_memory(RuntimeError("shapes do not match"), "fit") is None
    assert HeapBound(None).update() is None


def test_the_agent_says_so_when_auto_finds_no_tcmalloc(monkeypatch, caplog):
    from worker import cli

    monkeypatch.setattr(cli, "choose_allocator", lambda requested: choose(requested, _missing))
    with caplog.at_level("WARNING", logger="worker.cli"):
        assert cli._daemon_malloc("auto") is GLIBC
        assert cli._daemon_malloc("glibc") is GLIBC  # asked for: nothing to say
    assert len(caplog.records) == 1
    assert "apt-get install libtcmalloc-minimal4" in caplog.records[0].getMessage()

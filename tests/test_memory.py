"""Handing the C heap's free pages back to the operating system (``specjax._src.foundation.memory``)."""

from __future__ import annotations

import sys

import pytest

from specjax._src.foundation import memory


def _resident_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._malloc_trim() is None,
                    reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_heap_pages_go_back_to_the_system():
    # 300 MB in 100 kB blocks (below glibc's mmap threshold: they come from the heap), every 20th
    # kept so that the heap cannot shrink from its top: freed, the others stay resident until trimmed.
    blocks = [b"\x01" * 100_000 for _ in range(3000)]
    kept = blocks[19::20]
    del blocks
    freed = _resident_mb()
    assert memory.release_free_heap()
    trimmed = _resident_mb()
    assert freed - trimmed > 150, (freed, trimmed)
    assert len(kept) == 150 and all(b[0] == 1 for b in kept)  # what was in use is untouched


def test_without_malloc_trim_nothing_is_released(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.release_free_heap() is False

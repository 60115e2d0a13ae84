"""The process's memory as the kernel counts it (Linux ``/proc/self/smaps_rollup``): what a
snapshot holds, and what it has handed back lazily (``MADV_FREE``). Used by the memory tests
and ``bench/bench_async_save.py``; no pytest needed."""

from __future__ import annotations


def smaps_rollup() -> dict[str, int]:
    """Every byte count of ``/proc/self/smaps_rollup``, by field name (``Rss``, ``LazyFree``,
    ...), in bytes."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def held_and_lazily_freed() -> tuple[int, int]:
    """(resident memory the kernel cannot take back at will: Rss minus LazyFree, memory handed
    back with ``MADV_FREE`` that the kernel has not taken yet: LazyFree)."""
    fields = smaps_rollup()
    lazy = fields.get("LazyFree", 0)
    return fields["Rss"] - lazy, lazy

"""Python's garbage collector set for the suite's processes: the test workers and the gloo ranks.

A compile (torch.export, fx, fake tensors, sympy) allocates hundreds of thousands of container
objects, most of them garbage within the compile, beside the million that torch, transformers and
the test modules left alive at import. With Python's default thresholds (700, 10, 10) the collector
ran a hundred times per TinyGPT compiled and trained, each older-generation pass scanning those
imported objects again: 9% of that loop's CPU. Freezing what is alive once everything is imported
(never scanned again) and collecting the young generation every 10,000 allocations instead of 700
leaves the collector 2-3% (bench/suite_collector.py prints both). Only when the collector runs
changes: `gc.collect()` collects everything as before, so the tests that check memory and threads
are released call it and see the same.
"""

from __future__ import annotations

import gc

YOUNG_ALLOCATIONS = 10_000  # container allocations (net) between two collections of the youngest generation


def collect_less() -> None:
    """Collect once, freeze the survivors (the imported modules, classes and functions), and raise the
    youngest generation's threshold; the older generations keep Python's (10, 10)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_ALLOCATIONS, older, oldest)

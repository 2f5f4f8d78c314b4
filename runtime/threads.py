"""Long-lived stream threads: one per (device, stream), reused by every step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from stagewise.ir.instructions import Stream


class StreamThreads:
    """One long-lived thread per (device, stream), started at the first step and reused by every
    later one: starting a dozen threads per step cost more than a small stage's compute."""

    def __init__(self):
        self.queues: dict[tuple[int, Stream], queue.SimpleQueue] = {}

    def run(self, jobs: list[tuple[tuple[int, Stream], Callable[[], None]]]) -> None:
        """Run each job on its stream's thread, all at once; return when every job has returned."""
        finished = threading.Semaphore(0)
        for key, job in jobs:
            if key not in self.queues:
                self.queues[key] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self.queues[key],), name=f"dev{key[0]}-{key[1]}", daemon=True).start()
            self.queues[key].put((job, finished))
        for _ in jobs:
            finished.acquire()

    def close(self) -> None:
        """Let the threads end (the executor is gone)."""
        for jobs in self.queues.values():
            jobs.put(None)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (item := jobs.get()) is not None:
        job, finished = item
        try:
            job()
        finally:
            finished.release()
        del item, job  # hold no reference to the executor between steps

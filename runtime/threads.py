"""Long-lived stream threads: one per (device, stream), reused by every step; the caller waits
for a step's jobs with a deadline, so a job stuck in user code cannot hold it past `timeout_s`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from stagewise.ir.instructions import Stream


class StreamThreads:
    """One long-lived thread per (device, stream), started at the first step and reused by every
    later one: starting a dozen threads per step cost more than a small stage's compute. The
    caller sleeps until the last job finishes and is woken once, not once per job. (It runs none
    of the jobs itself: its thread-local state, such as grad mode or autocast, would reach that
    job only.)"""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, Stream], queue.SimpleQueue] = {}

    def start(self, jobs: list[tuple[tuple[int, Stream], Callable[[], None]]]) -> Countdown:
        """Run each job on its stream's thread, all at once; the countdown tells when every job has
        returned. A thread whose job is still running (stuck in user code) takes its next job only
        after: the caller must not start another step before the countdown is done."""
        finished = Countdown(len(jobs))
        for key, job in jobs:
            if key not in self.queues:
                self.queues[key] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self.queues[key],), name=f"dev{key[0]}-{key[1]}", daemon=True).start()
            self.queues[key].put((job, finished))
        return finished

    def close(self) -> None:
        """Let the threads end (the executor is gone)."""
        for jobs in self.queues.values():
            jobs.put(None)


class Countdown:
    """Jobs still running; `wait` returns once the last one counted down (one wake-up, not one per job)."""

    def __init__(self, jobs: int):
        self.left = jobs
        self.lock = threading.Lock()
        self.all_done = threading.Lock()
        self.all_done.acquire()
        if jobs == 0:
            self.all_done.release()

    def count_down(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.all_done.release()

    def wait(self, timeout_s: float) -> bool:
        """Whether every job returned, waiting at most `timeout_s` for it (a done countdown stays done)."""
        if not self.all_done.acquire(True, max(timeout_s, 0.0)):
            return False
        self.all_done.release()
        return True

    def done(self) -> bool:
        return self.wait(0.0)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (item := jobs.get()) is not None:
        job, finished = item
        try:
            job()
        finally:
            finished.count_down()
        del item, job  # hold no reference to the executor between steps

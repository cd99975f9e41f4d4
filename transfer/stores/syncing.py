"""The file store's sync threads: each chunk's fdatasync and rename run beside the sealing threads.

A ``ThreadPoolExecutor`` did this, one ``submit`` per chunk: a Future, a work item and a semaphore probe, each of
them Python code under the GIL (``threading.Semaphore`` and ``Condition`` are written in Python), and the Future's
result set under its condition afterwards. In a live capture round every chunk paid it on a sealing thread, and a
py-spy profile of one (bench/HISTORY.md, fifteenth session) had that ``submit`` among the largest holders of the
GIL beside the workload's own threads. Here a job costs a lock held for an add and a ``SimpleQueue.put`` (both C), and
a wait for all of them is one event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

_STOP = None


class SyncThreads:
    """``threads`` threads running the jobs given to :meth:`submit`, started at the first one."""

    def __init__(self, threads: int, name: str) -> None:
        self._count = max(1, threads)
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._errors: list[BaseException] = []
        self._idle = threading.Event()
        self._idle.set()
        self._threads: list[threading.Thread] = []

    @property
    def running(self) -> int:
        """Threads started (0 until the first job, and after :meth:`close`)."""
        with self._lock:
            return len(self._threads)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._run, name=f"{self._name}_{i}", daemon=True)
                    for i in range(self._count)
                ]
                for t in self._threads:
                    t.start()
            if self._pending == 0:
                self._idle.clear()
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                job()
            except BaseException as exc:  # kept for wait(): the store's flush reports it
                with self._lock:
                    self._errors.append(exc)
            finally:
                # A job closes over its store: a thread waiting for the next job must not keep the last one (and
                # with it the store, its directory fds and these threads) alive.
                job = None
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def wait(self) -> list[BaseException]:
        """Once every job submitted so far has run (even after a failure: none still runs after this returns), the
        errors they raised since the last wait, oldest first."""
        self._idle.wait()
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def release(self) -> None:
        """End the threads once the jobs given so far have run, without waiting for them: a collected store's
        finalizer, which may run on one of these threads."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(_STOP)

    def close(self) -> None:
        """Wait for the jobs, then end the threads (a later submit starts new ones)."""
        self._idle.wait()
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(_STOP)
        for t in threads:
            t.join()

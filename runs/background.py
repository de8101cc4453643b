"""One background thread of the process, the way the process's helpers all need it.

The Celery publisher (runs/publisher.py), the live wake-ups' Redis publisher and listener
(runs/live/events.py) and the look lane (runs/live/looks.py) each keep work off a request's
thread on one daemon thread of their own. What they share is here, once:

- started on demand, by the first hand-over, and again if it ever died;
- fork-safe: a forked child (granian's and Celery's workers) has none of its parent's threads,
  and a lock its parent held at the fork would never be released in it, so the child starts
  from fresh state and starts its own thread when it first needs one;
- stoppable: ``stop()`` asks the thread to end at its next wait and joins it (tests and an
  orderly exit; the server never needs it, the thread being a daemon).

A subclass keeps its state in ``_reset`` (calling this class's), hands work over under
``_cond`` and calls ``_start()`` there, and writes its loop in ``_serve``, waiting only through
``_wait_for`` and ``_rest``, which say when to stop.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class BackgroundThread:
    """See the module docstring."""

    name = "background"  # the thread's name, as a thread dump shows it

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """Fresh state: at creation and in a forked child. Subclasses add their own."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def _start(self) -> None:
        """Start the thread unless it runs; the caller holds ``_cond``. While a ``stop()`` is
        under way the old thread is left to end: work handed over meanwhile waits for the
        next hand-over after it has."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _serve(self) -> None:
        """The thread's loop: returns once ``_wait_for`` or ``_rest`` says to stop."""
        raise NotImplementedError

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        """Wait, holding ``_cond`` on return, until ``ready()``; False if the thread is to
        stop instead."""
        self._cond.wait_for(lambda: self._stopping or ready())
        return not self._stopping

    def _rest(self, seconds: float) -> bool:
        """Sleep ``seconds`` (a hand-over does not cut it short); False if the thread is to
        stop instead."""
        with self._cond:
            return not self._cond.wait_for(lambda: self._stopping, timeout=seconds)

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the thread to end at its next wait and wait up to ``timeout`` seconds for it;
        True once no thread runs. The next hand-over starts a new one."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

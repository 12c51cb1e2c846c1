"""A child process that ends itself once the process that started it is gone.

A zoo builder or a policy worker computes for minutes between two messages from its parent; killed
with ``kill -9``, the parent cannot stop them, and they would run on (a study stopped by hand left
its local scheduler's workers computing). A daemon thread watches the parent's pid instead: once the
child has been re-parented, it exits at once (``os._exit``: nothing half-written is renamed into
place, every writer here writes to a temporary path and renames at the end).
"""

from __future__ import annotations

import os
import threading
import time

PARENT_CHECK_S = 1.0
"""How often a child checks that its parent is still there."""
ORPHANED_EXIT = 3
"""A child's exit code when its parent went away."""


def exit_when_orphaned(parent: int, every_s: float = PARENT_CHECK_S,
                       code: int = ORPHANED_EXIT) -> threading.Thread:
    """Start a daemon thread that ends this process with exit ``code`` once its parent is no longer
    ``parent`` (pass the parent's pid as the parent gave it: a parent that died before this call is
    caught too, where ``os.getppid()`` would already name the new one)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(code)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t

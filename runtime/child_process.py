"""What a child process of the supervisor (``runtime.multiproc``) does first: ``die_with_parent``. Apart from
the supervisor so that the engine and the workers need not import it (the supervisor imports them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

__all__ = ["die_with_parent"]


def die_with_parent() -> None:
    """Make this child process end when its parent (the supervisor) does, however the parent ends
    (SIGKILL included): Linux's ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, and a thread watching
    ``os.getppid()`` where prctl is missing. Without it a killed supervisor would leave its engine and
    workers serving the port, unsupervised."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

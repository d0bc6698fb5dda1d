"""End ``train.py``'s process after a finished run without Python's teardown of the interpreter.

Once the run has returned, its files are written and closed, the logger has finished, the other threads have been
joined and every exit handler has run. What the interpreter's finalisation would do next, clearing every module and
freeing each of Lightning's and torch's objects one at a time, only hands back memory that the operating system
takes back at once when the process ends. :func:`arm` registers an exit handler that ends the process there with
the run's status (:func:`finished`); a run that raised, or a process that never called :func:`finished`, exits as
usual.

Exit handlers run last-registered first, so this one, registered before the run, runs after every handler registered
later (W&B's teardown, ``weakref.finalize``, temporary directories). Of those registered before it, the package's
import registers only :mod:`logging`'s, which the handler runs itself (``logging.shutdown``). Should anything else
have registered one before (a tool that measures the process at exit, such as coverage's subprocess mode), the handler
is not armed and the process exits as usual.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys

_armed = False
_status: int | None = None


def arm() -> bool:
    """Register the exit handler, unless a handler that it would skip was registered before; whether it is armed.

    Call it first thing in the process (``train.py`` does), before anything registers exit handlers of its own.
    """
    global _armed  # one handler per process
    count = getattr(atexit, "_ncallbacks", None)  # CPython's count of registered handlers; elsewhere: not armed
    if _armed or count is None or count() > _known_before():
        return _armed
    atexit.register(_end_process)
    _armed = True
    return True


def finished(status: int = 0) -> None:
    """Mark the run as over: at exit, once the handlers registered after :func:`arm` have run, the process ends."""
    global _status  # read by the exit handler
    _status = status


def _known_before() -> int:
    """How many exit handlers the imports before :func:`arm` register that :func:`_end_process` runs itself."""
    return 1 if "logging" in sys.modules else 0  # logging.shutdown, registered when logging is imported


def _end_process() -> None:
    """The exit handler: after :func:`finished`, flush what is buffered and end the process with its status."""
    if _status is None:
        return  # the run raised (or never finished): the interpreter's own teardown, as without this module
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()  # its own exit handler was registered before this one: it would not run
    _flush_open_files()
    os._exit(_status)


def _flush_open_files() -> None:
    """Flush the standard streams and every file object still open, as the teardown would when it frees them.

    A user's callback or module may leave a file open and count on the interpreter to write out its buffer. Files
    opened during the imports that :mod:`~fl_lightning.startup.heap` froze are not searched: nothing of the run's is
    among them.
    """
    files = [sys.stdout, sys.stderr, *(obj for obj in gc.get_objects() if isinstance(obj, io.IOBase))]
    for file in files:
        try:
            file.flush()  # a text file flushes its binary buffer too; a read-only file has nothing to write
        except (AttributeError, OSError, ValueError):  # closed, replaced, detached or broken: nothing to flush
            pass

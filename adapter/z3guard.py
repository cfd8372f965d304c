"""One guard for every Z3 call of the gate (boundary scenarios, proofs rows).

Z3's C objects are not thread-safe, and a Python Z3 object is freed (``Z3_dec_ref``) by
whichever thread's cyclic garbage collection finds it: a progress bar's refresh thread
could free Z3 objects while the main thread is inside ``Solver.check``, which corrupts Z3's
allocator (seen as a segfault in ``small_object_allocator::allocate`` during a gate run).
Inside ``z3_alone()`` the cyclic collector is held off and a lock keeps Z3 to one thread;
the garbage made meanwhile is collected on the way out, in the same thread. Everything the
body allocated is still in the youngest generation then (no collection ran), so collecting
generations 0 and 1 frees it: a full collection would also walk the whole heap (vLLM and
torch loaded: about 0.35 s a call, 11 s of a profile-quick boundary check's 12).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.RLock()


@contextlib.contextmanager
def z3_alone() -> Iterator[None]:
    """Run the body with no cyclic garbage collection anywhere in the process and no other
    thread inside a ``z3_alone`` block; collect the body's garbage (the young generations)
    here before returning."""
    with _LOCK:
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            gc.collect(1)
            if enabled:
                gc.enable()

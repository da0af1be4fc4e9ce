"""Large temporaries without page faults: the process keeps the memory it frees.

glibc's malloc hands every allocation over its mmap threshold (dynamic, at most 32 MB by default)
fresh pages from the kernel and returns them on free; the kernel zeroes each page on first touch.
A decode step at 64 requests allocates its LM head output, [64, 262144] in bf16 (33.5 MB) and
again in fp32 (67 MB), and a verify step more: every step paid for zeroing them. Allocating and
filling 67 MB after ten warm-up rounds took 10.2-11.6 ms by default and 0.9-1.4 ms with the
thresholds below (this 2-core EPYC, 16,385 page faults against none); the head at 64 rows inside
the engine ran 36-45 ms by default and 27 ms with them, and a level of 64 streams (two engines
on plan_trace.py's requests) 14.8-16.7 s against 17.8-19.5 s.

So the commands ask glibc to serve allocations under 256 MB from its main heap (the server's
engine thread's too: a thread's own arena mmaps whatever exceeds its 64 MB heaps, and the
server's heads at 64 requests still ran 39 ms) and to keep up to
256 MB of what is freed at its top (`keep_freed_memory`), as the caching allocators of jemalloc,
tcmalloc and CUDA keep freed memory for the next request. Bounded: with no bound (1 GiB and
never trimmed) each process held its peak of temporaries for good, and a server sweep's six
servers beside the benchmark's own engines ran a 24 GB machine out of memory. Where
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or MALLOC_ARENA_MAX is set, or the C library is not
glibc, nothing changes. The Python API leaves it to the caller, whose process it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
KEEP = 256 << 20  # allocations under this come from the heap; up to this much freed memory stays there


def keep_freed_memory() -> bool:
    """Serve allocations under KEEP from the heap, every thread's from the main one, and trim its
    top only past KEEP of free memory. Call it before other threads allocate. True where it took
    effect."""
    if any(v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")):
        return False  # the user's choice
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # one arena: a thread's allocations otherwise come from an arena of its own, whose heaps are
    # 64 MB at most and mmap whatever is larger (the server's engine thread: the head's 67 MB)
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, KEEP), (M_TRIM_THRESHOLD, KEEP), (M_ARENA_MAX, 1)))
    if not ok:
        log.debug("mallopt refused the thresholds; freed memory goes back to the kernel")
    return ok

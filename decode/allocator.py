"""Keep a CPU process's freed tensor memory for its next tensors, as a long-running server's allocator ends up doing.

    from decode.allocator import steady_heap
    steady_heap()  # once, at start-up; `python -m decode ...` calls it for you

PyTorch's CPU tensors come from glibc's malloc. There a block above the mmap threshold (128 KiB at first) is mapped
fresh and unmapped when freed, so every forward's large tensors (batch x vocabulary logits, attention scores, the
KV buffers a round grows) fault their pages in again. glibc raises that threshold by itself once it frees a large
mapped block, so a process speeds up as it runs, and by how much depends on what it allocated before: on this 2-core
CPU with the embedded pair, the target alone at batch 128 ran 1390-1450 tok/s over five runs in a row and 1620-1690
after a fixed K = 6 batch had run once; at batch 256 it ran 1410-1430 tok/s. With the thresholds fixed at 1 GiB from
the start it ran 1850-2050 at batch 128 and 2020-2070 at batch 256, every run (a scratch script, greedy, 32 new
tokens). A benchmark that lets the history decide compares methods by what ran before them.

steady_heap() fixes the mmap and trim thresholds (mallopt), so memory freed by one forward serves the next without
going back to the kernel: the process keeps up to that much freed memory mapped. SPECHEADS_MALLOC=default leaves
glibc's defaults. Elsewhere (not Linux with glibc) it does nothing and says so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD = 1 << 30  # 1 GiB: above any one tensor this project decodes with on a CPU


def steady_heap(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes -> whether they were set (False: not glibc, or
    SPECHEADS_MALLOC=default)."""
    if os.environ.get("SPECHEADS_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))

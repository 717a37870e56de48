"""The server keeps large buffers off glibc's heap (app.memory.keep_large_buffers_off_the_heap):
a freed request-sized buffer goes back to the OS at once, instead of staying in the heap for the
next allocation to fragment (RSS then grows under load until a malloc_trim; bench/memory_soak.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import sys, torch
    from app.memory import keep_large_buffers_off_the_heap

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    if sys.argv[1] == "fixed":
        keep_large_buffers_off_the_heap()
    base = rss_mb()
    for _ in range(3):   # a request's KV cache, then something small that outlives it
        big = torch.ones(20 * 2**20 // 4)
        keep = torch.ones(1000)
        del big
    print(rss_mb() - base)
""")


def retained_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_a_freed_request_sized_buffer_goes_back_to_the_os():
    assert retained_mb("default") > 15   # glibc on its own keeps the 20 MB for later (the failure mode)
    assert retained_mb("fixed") < 8

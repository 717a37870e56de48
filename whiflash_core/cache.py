"""Where whiflash keeps what it computes once per machine: format timings (machine.py), the Q4_1
kernel's build (q4_1_kernel.py) and GGUF models converted for fast loading (loading.py)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$WHIFLASH_CACHE_DIR, else $XDG_CACHE_HOME/whiflash, else ~/.cache/whiflash."""
    root = os.environ.get("WHIFLASH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "whiflash")
    return Path(root)

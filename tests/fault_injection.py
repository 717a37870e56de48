"""`whiflash serve` with a fault that no request can cause, for tests of the engine-thread guard.

Once the file named by WHIFLASH_TEST_WORKER_FAULT exists, the engine worker raises outside any
one request's round (in `Scheduler._deliver`, as a bug in the scheduler itself would), so that the
top-level guard (503 for open and new requests, /health 503) can be tested against the real
server. Run as `python tests/fault_injection.py serve ...`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from app.scheduler import Scheduler
from whiflash_core.cli import main

FLAG = Path(os.environ["WHIFLASH_TEST_WORKER_FAULT"])
_deliver = Scheduler._deliver


def _faulty_deliver(self, slot):
    if FLAG.exists():
        raise RuntimeError("injected fault in the engine worker")
    return _deliver(self, slot)


if __name__ == "__main__":
    Scheduler._deliver = _faulty_deliver
    sys.exit(main())

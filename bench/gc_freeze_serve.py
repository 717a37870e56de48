"""`whiflash serve` with its cyclic-GC pauses counted, the start-up heap frozen (`on`, as shipped:
app.memory.freeze_startup_heap) or not (`off`), for bench/gc_freeze_ab.sh:

    .venv/bin/python bench/gc_freeze_serve.py on|off --port 8032 --threads 2

SIGUSR1 resets the counts, SIGUSR2 prints them to stderr (runs, total and worst pause per generation).
"""
import collections
import gc
import os
import signal
import sys
import time

arm = sys.argv[1]
spent, runs, worst = collections.Counter(), collections.Counter(), collections.Counter()
started = [0.0]


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
        return
    pause, g = time.perf_counter() - started[0], info["generation"]
    spent[g] += pause
    runs[g] += 1
    worst[g] = max(worst[g], pause)


def reset(*_) -> None:
    for counts in (spent, runs, worst):
        counts.clear()


def show(*_) -> None:
    per = ", ".join(f"gen{g}: {runs[g]} runs {1000 * spent[g]:.0f} ms worst {1000 * worst[g]:.1f} ms" for g in sorted(runs))
    print(f"GC[{arm}] {per}; total {1000 * sum(spent.values()):.0f} ms", file=sys.stderr, flush=True)


gc.callbacks.append(on_gc)
signal.signal(signal.SIGUSR1, reset)
signal.signal(signal.SIGUSR2, show)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if arm == "off":
    import app.memory
    app.memory.freeze_startup_heap = lambda: 0   # serve_cli imports it at run time: this one
from whiflash_core.cli import main  # noqa: E402

sys.exit(main(["serve", *sys.argv[2:]]))

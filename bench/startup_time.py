"""How long the default engine takes to load: first on this machine (the format, verify and context
timings all measured: a fresh cache holding only the GGUF's conversion and the built kernels, so
that neither of those one-off costs is counted) and again with everything cached. Run it against
two trees with PYTHONPATH to compare versions on one machine in one sitting.

    PYTHONPATH=. python bench/startup_time.py --threads 1 --out bench/results/startup_zen3.json
    PYTHONPATH=/tmp/old python bench/startup_time.py --threads 1 --out /tmp/old.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from whiflash_core.bench.report import machine_info
    from whiflash_core.cache import cache_root

    warm = cache_root()
    with tempfile.TemporaryDirectory() as fresh:
        for kept in ("converted", "kernels"):   # one-off costs of a machine, not of a start
            if (warm / kept).exists():
                shutil.copytree(warm / kept, os.path.join(fresh, kept))
        os.environ["WHIFLASH_CACHE_DIR"] = fresh
        import whiflash_core
        from whiflash_core.loading import load_engine

        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            engine = load_engine(None, None, "bfloat16", threads=args.threads, weights=args.weights)
            times.append(round(time.perf_counter() - t0, 2))
        formats = engine.target.formats
    git = subprocess.run(["git", "-C", os.path.dirname(whiflash_core.__file__), "rev-parse", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "code": whiflash_core.__file__,
              "git": git, "machine": machine_info("bfloat16", args.threads),
              "first_load_s": times[0], "cached_load_s": times[1],
              "formats": None if formats is None else formats.__dict__}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("code", "first_load_s", "cached_load_s", "formats")}))


if __name__ == "__main__":
    main()

"""Verify-forward times by row count with a given decode_ops.MAX_ATTENTION_ROWS (rows per request
through the C attention and the layer stack; more rows take the module forward and SDPA).

    .venv/bin/python bench/attention_rows_probe.py 8; .venv/bin/python bench/attention_rows_probe.py 16

One setting per process (the layer stack reads it when the target loads): the embedded target,
--weights auto, the drafters' taps on, 300 cached positions, one thread; per row count the 1/3
quantile of 15 forwards after 10 warm-up ones, in ms. Results: bench/results/attention_rows_check.txt.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import decode_ops  # noqa: E402

decode_ops.MAX_ATTENTION_ROWS = int(sys.argv[1])
from whiflash_core.loading import load_engine  # noqa: E402

eng = load_engine(None, None, "bfloat16", threads=1, weights="auto", measure_costs=False)
tgt = eng.target
ids = torch.randint(0, tgt.cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    c = tgt.new_cache(600)
    tgt(ids[:300], c)
    for _ in range(10):
        tgt(ids[300:301], c, eng.tap_layers)
        c.rollback(300)
    out = []
    for r in (1, 4, 8, 9, 12, 16):
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            tgt(ids[300:300 + r], c, eng.tap_layers)
            ts.append(time.perf_counter() - t0)
            c.rollback(300)
        ts.sort()
        out.append(f"T({r})={ts[len(ts) // 3] * 1e3:.2f}")
print(sys.argv[1], " ".join(out))

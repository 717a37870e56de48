"""schemathesis against the live server's OpenAPI document: every POST route's body fuzzed (valid
and invalid, schemathesis's examples, coverage and fuzzing phases), and not one 5xx or hang.

Slow (minutes) and needs the optional `fuzz` extra: `pip install -e '.[fuzz]'`, then
`pytest -m slow tests/test_fuzz.py`. Its report (command line, cases, status codes, the CPU) goes
to tests/artifacts/schemathesis.json, and when it passes with WHIFLASH_UPDATE_FUZZ_REPORT=1 to
bench/results/schemathesis.json.

The server generates at most 16 tokens per answer (`--default-max-tokens 16`, and
tests/fuzz_hooks.py caps larger fuzzed max_tokens and max_output_tokens), so that a valid request takes seconds: what is
looked for is errors and hangs, not long answers. A hang is a request without an answer within
REQUEST_TIMEOUT_S (schemathesis records it as a failed request).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 60
MAX_EXAMPLES = 100   # per operation, in the fuzzing phase
SEED = 18


def cpu_model() -> str:
    """lscpu's model name (as .ci/run prints it), else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = Path("/proc/cpuinfo").read_text()
    for line in out.splitlines():
        if line.lower().startswith(("model name", "model name:")):
            return line.split(":", 1)[1].strip()
    return "unknown"


def st_run_args(url: str, har: str) -> list[str]:
    """`st` arguments: the POST routes of the document, valid and invalid bodies, a fixed seed."""
    return ["run", f"{url}/openapi.json", "--include-method", "POST", "--phases", "examples,coverage,fuzzing",
            "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
            "--checks", "not_a_server_error", "--request-timeout", str(REQUEST_TIMEOUT_S),
            "--suppress-health-check", "all", "--report", "har", "--report-har-path", har, "--no-color"]


def test_schemathesis_finds_no_server_error_and_no_hang(tmp_path):
    schemathesis = pytest.importorskip("schemathesis", reason="the optional `fuzz` extra is not installed: "
                                                              "pip install -e '.[fuzz]'")
    import httpx

    from conftest import start_server

    server = start_server("--dtype", "float32", "--default-max-tokens", "16", log_dir=tmp_path)
    har = tmp_path / "schemathesis.har"
    try:
        env = {**os.environ, "SCHEMATHESIS_HOOKS": str(REPO / "tests" / "fuzz_hooks.py")}
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "schemathesis.cli", *st_run_args(server.url, str(har))],
                             env=env, cwd=tmp_path, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        alive = server.proc.poll() is None
        health = httpx.get(server.url + "/health", timeout=10).status_code if alive else None
    finally:
        server.stop()
    summary = run.stdout[-8000:] + run.stderr[-2000:]
    assert alive, f"the server died under the fuzzer:\n{server.log_tail()}"

    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter((e.get("response") or {}).get("status", 0) for e in entries)
    by_route = Counter(f'{e["request"]["method"]} {e["request"]["url"].removeprefix(server.url)} -> '
                       f'{(e.get("response") or {}).get("status", 0)}' for e in entries)
    report = {
        "command": "st " + " ".join(st_run_args("http://127.0.0.1:PORT", "schemathesis.har")),
        "hooks": "SCHEMATHESIS_HOOKS=tests/fuzz_hooks.py (fuzzed max_tokens, max_completion_tokens, max_output_tokens above 16 become 16)",
        "server": "whiflash serve --dtype float32 --default-max-tokens 16 --threads 1",
        "schemathesis": schemathesis.__version__,
        "cases": len(entries),
        "status_codes": {str(k): v for k, v in sorted(statuses.items())},
        "by_route": dict(sorted(by_route.items())),
        "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "no_answer": statuses.get(0, 0),
        "schemathesis_exit_code": run.returncode,
        "health_after": health,
        "seconds": round(seconds, 1),
        "cpu": cpu_model(),
    }
    out = REPO / "tests" / "artifacts" / "schemathesis.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    assert entries and report["server_errors_5xx"] == 0 and report["no_answer"] == 0, summary
    assert run.returncode == 0, summary  # no failure of any kind: 5xx, timeout, dropped connection
    assert health == 200
    if os.environ.get("WHIFLASH_UPDATE_FUZZ_REPORT") == "1":  # the committed report: passing runs only
        shutil.copyfile(out, REPO / "bench" / "results" / "schemathesis.json")

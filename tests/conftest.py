"""Shared fixtures: a live `whiflash serve` subprocess on 127.0.0.1.

`live_server` (session scope) starts one server for the whole run and kills it at the end; other
test modules can reuse it. `start_server(...)` starts extra ones (e.g. with --api-key). Servers run
with one torch thread (the test machine has few cores); their logs go under the pytest tmp dir and
the tail is shown if a server dies during startup.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = float(os.environ.get("WHIFLASH_TEST_STARTUP_TIMEOUT", "300"))


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers: one alone kept a 2-core CI machine 99 %
    busy on one core) each worker takes its share of the cores, so the workers' forwards do not
    oversubscribe them; servers the tests start run on one thread anyway (start_server)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from whiflash_core.machine import _our_cpus   # the CPUs this process may run on

        share = max(1, len(_our_cpus()) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, restored after (small training runs, reproducible and
    out of the way of a server the same run started)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str = "none"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key)
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key)
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.AsyncOpenAI(base_url=self.base_url, **kw)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _command() -> list[str]:
    script = Path(sys.executable).parent / "whiflash"
    return [str(script)] if script.exists() else [sys.executable, "-m", "whiflash_core.cli"]


def start_server(*args: str, log_dir: Path, api_key: str | None = None, env: dict | None = None,
                 command: list[str] | None = None) -> LiveServer:
    """`command`: what runs the CLI instead of `whiflash` (e.g. a wrapper that injects a fault)."""
    port = free_port()
    log_path = log_dir / f"whiflash-serve-{port}.log"
    cmd = (command or _command()) + ["serve", "--host", "127.0.0.1", "--port", str(port), "--threads", "1", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WHIFLASH_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
    server = LiveServer(proc, port, log_path, api_key or "none")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"whiflash serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"whiflash serve did not become healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


# The shared server runs the float32 reference path: there every method's output equals plain
# decoding by construction, on any CPU, so the gateway tests may compare methods. In bf16 or int4 a
# k-row verify rounds differently from a 1-row decode (and differently again on another CPU's
# kernels); what holds there is tested against the `make run` configuration in test_any_cpu.py.
LIVE_SERVER_ARGS = ("--dtype", "float32")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    server = start_server(*LIVE_SERVER_ARGS, log_dir=tmp_path_factory.mktemp("server"))
    yield server
    server.stop()

"""`whiflash serve`: the OpenAI-compatible gateway under uvicorn.

Settings come from `WHIFLASH_*` environment variables (see app/settings.py); flags override them.
"""
from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from whiflash_core.engine import Engine

    from .settings import Settings


def add_parser(sub) -> None:
    from whiflash_core.router import METHODS
    from whiflash_core.quant import WEIGHT_FORMATS

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # every default is None: an absent flag leaves the environment / built-in default in place
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--drafters", default=None, help="drafter directory (default: the shipped drafters)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float64", "float16"])
    p.add_argument("--weights", default=None, choices=WEIGHT_FORMATS,
                   help="auto (default): the formats this CPU runs fastest, timed per phase and cached "
                        "(whiflash info); int4: the GGUF's Q4_1 blocks through the CPU int4 matmul, LM head "
                        "int8; int8: every linear per-row int8; dense: the dtype's own weights")
    p.add_argument("--served-model-name", default=None, help="model id reported by the API")
    p.add_argument("--model-alias", dest="model_aliases", nargs="*", action="extend", default=None,
                   help="further model ids accepted in requests (repeatable); any other id is a 404")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes; several keys, comma-separated, are "
                        "separate tenants (the stats page shows each only its own requests' text)")
    p.add_argument("--admin-key", default=None,
                   help="a stats-page viewer presenting this key sees every request's text (also an API key)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores torch may use); target forwards of "
                        "--large-forward-rows rows or more use them all")
    p.add_argument("--step-threads", type=int, default=None,
                   help="torch threads of decode, verify and drafting (default: one fewer than --threads, at least 1)")
    p.add_argument("--large-forward-rows", type=int, default=None,
                   help="target forwards of this many rows or more (prefills, several requests' verify rows) run "
                        "on --threads, smaller ones on --step-threads (default: whiflash_core.engine.LARGE_FORWARD_ROWS)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the target and drafters run (default: cuda when available, else cpu)")
    p.add_argument("--max-active", type=int, default=None, help="generations interleaved at once (default 16)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (default 64)")
    p.add_argument("--no-shared-forwards", dest="shared_forwards", action="store_false", default=None,
                   help="one target forward per request and round instead of one for all active requests")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per request (default 600)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, larger ones get 413 before parsing (default 2 MiB)")
    p.add_argument("--malloc-arena-max", type=int, default=None,
                   help="glibc malloc arenas, as MALLOC_ARENA_MAX (default 2; 0: glibc's default of 8 per core)")
    p.add_argument("--kernel-cache-entries", type=int, default=None,
                   help="shapes kept in each of oneDNN's and PyTorch's bf16 matmul kernel caches (default 128; "
                        "their own default of 1,024 let the heap grow with every new prompt length)")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="prefix cache memory in MiB, 0 = off (default 512): later turns of a conversation "
                        "reuse the K/V of the earlier ones")
    p.add_argument("--cors-origins", nargs="*", default=None, help="allowed CORS origins ('*' for any)")
    p.add_argument("--speculation-method", default=None, choices=METHODS,
                   help="default method (default: the best one the loaded drafters allow)")
    p.add_argument("--speculation-alpha", type=float, default=None, help="default router alpha (0..1)")
    p.add_argument("--default-max-tokens", type=int, default=None)
    p.add_argument("--force-include-usage", action="store_true", default=None,
                   help="send the usage chunk on every stream")
    p.add_argument("--parallel-tool-calls", action="store_true", default=None,
                   help="allow several tool calls per turn when a request does not say (default: one)")
    p.add_argument("--log-level", default=None)
    # scale-out (app/replicas.py; needs the `replicas` extra: pip install 'whiflash[replicas]')
    p.add_argument("--replicas", type=int, default=None,
                   help="engine replicas behind one endpoint on Ray Serve, with conversation affinity "
                        "(default 1: this process serves, no Ray)")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="GPUs reserved per replica (default: 1 on cuda, else 0)")
    p.add_argument("--ray-address", default=None,
                   help="deploy the replicas on this Ray cluster (default: start a local one)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace):
    from .settings import Settings

    overrides = {k: v for k, v in vars(args).items() if k not in ("func", "command") and v is not None}
    return Settings(**overrides)  # init kwargs take precedence over WHIFLASH_* variables


def replica_settings_from_args(args: argparse.Namespace):
    """The scale-out settings when more than one replica is asked for (--replicas or
    WHIFLASH_REPLICAS), else None: the single-process server, which never imports Ray."""
    from .settings import ReplicaSettings

    overrides = {k: v for k, v in vars(args).items() if k not in ("func", "command") and v is not None}
    settings = ReplicaSettings(**overrides)
    if settings.replicas == 1:
        return None
    try:
        import ray.serve  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "ray":
            raise SystemExit("--replicas needs Ray Serve: pip install 'whiflash[replicas]'") from None
        raise
    return settings


def load_server_engine(settings: Settings) -> Engine:
    """The engine a server (or one replica) serves: rounds on `step_threads` (the cost model is timed
    so), target forwards of LARGE_FORWARD_ROWS rows or more (prefills, several requests' verify
    rows) on all `threads` (Engine.threads_for)."""
    import torch

    from whiflash_core.loading import load_engine

    threads, step_threads = settings.engine_threads(torch.get_num_threads())
    torch.set_num_threads(step_threads)
    engine = load_engine(settings.model, settings.drafters, settings.dtype, threads=step_threads,
                         weights=settings.weights, device=settings.device)
    engine.large_threads = threads
    if settings.large_forward_rows is not None:
        engine.large_from_rows = settings.large_forward_rows
    return engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .main import create_app
    from .memory import bound_kernel_caches, freeze_startup_heap, limit_malloc_arenas

    settings = settings_from_args(args)
    limit_malloc_arenas(settings.malloc_arena_max)  # before the engine and server start their threads
    bound_kernel_caches(settings.kernel_cache_entries)  # before the engine's first matmul
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replicas = replica_settings_from_args(args)
    if replicas is not None:
        from .replicas import serve_replicas   # Ray is imported only here

        return serve_replicas(settings, replicas)
    app = create_app(load_server_engine(settings), settings)
    freeze_startup_heap()   # the engine's and app's objects live as long as the server: no GC passes over them
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=5)
    return 0

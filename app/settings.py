"""Server settings: environment variables `WHIFLASH_<NAME>`, overridden by `whiflash serve` flags."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from whiflash_core.config import SpeculationConfig, speculation_field
from whiflash_core.constraints import GRAMMAR_CACHE_BYTES
from whiflash_core.quant import WeightFormat
from whiflash_core.router import Method


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WHIFLASH_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = Field(None, description="HF model directory or .gguf (default: embedded SmolLM2)")
    drafters: str | None = Field(None, description="drafter directory (default: the shipped drafters)")
    dtype: Literal["bfloat16", "float32", "float64", "float16"] = "bfloat16"
    weights: WeightFormat = Field(
        "auto", description="auto: timed on this CPU per phase (whiflash info); int4: the GGUF's Q4_1 "
                            "blocks; int8: per-row int8 linears; dense: the dtype's own weights")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's, the cores it may "
                                                        "use); target forwards of `large_forward_rows` rows or "
                                                        "more run on all of them")
    step_threads: int | None = Field(
        None, ge=1, description="torch threads of decode, verify and drafting (default: one fewer than `threads`, "
                                "at least 1: the HTTP loop, tokenizer and clients keep a core; Engine.threads_for)")
    large_forward_rows: int | None = Field(
        None, ge=1, description="target forwards of this many rows or more (prefills, several requests' verify "
                                "rows) run on `threads`, smaller ones on `step_threads` (default: "
                                "whiflash_core.engine.LARGE_FORWARD_ROWS)")
    device: Literal["cpu", "cuda"] | None = Field(None, description="cuda or cpu (default: cuda when available)")
    served_model_name: str | None = None
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="further names accepted as `model` (others: 404 model_not_found)")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' on the API; several keys, comma-separated, are "
                          "separate tenants (each sees only its own requests' text on the stats feed)")
    admin_key: str | None = Field(
        None, description="a stats-feed viewer presenting this key sees every request's text (it is also "
                          "accepted as an API key); never in a URL")
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "info"

    # scheduling
    max_active: int = Field(16, ge=1, description="generations stepped round-robin at once")
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot before 429s")
    shared_forwards: bool = Field(True, description="step the active requests' rounds together, their verify "
                                                    "rows in one target forward (off: one forward each)")
    request_timeout: float = Field(600.0, gt=0, description="seconds from arrival to the last token")
    prefix_cache_mb: float = Field(
        512, ge=0, description="memory for the K/V of earlier requests' prefixes, reused by later requests "
                               "that start the same way (agent loops); 0 turns the prefix cache off")
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1,
                                   description="largest request body accepted (larger: 413, before parsing)")
    malloc_arena_max: int = Field(
        2, ge=0, description="glibc malloc arenas (as MALLOC_ARENA_MAX; 0: glibc's default, 8 per core): few "
                             "arenas let RSS return to its level after large requests (app/memory.py)")

    kernel_cache_entries: int = Field(
        128, ge=1, description="shapes kept in each of oneDNN's and PyTorch's bf16 matmul kernel caches (1,024 "
                               "by default, ~0.25 MB each: the heap grew with every new prompt length; "
                               "app/memory.py)")

    # grammars (tool_choice required / named, response_format): compiled in their own pool
    grammar_timeout: float = Field(10.0, gt=0, description="seconds a request waits for its grammar (then a 400)")
    grammar_queue: int = Field(4, ge=1, description="grammars compiling or waiting at once (beyond: 429)")
    grammar_cache_bytes: int = Field(GRAMMAR_CACHE_BYTES, ge=0, description="xgrammar's compiled-grammar cache")

    # request defaults
    default_max_tokens: int | None = Field(None, ge=1, description="None: up to the context length")
    default_temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    default_top_p: float = Field(1.0, gt=0.0, le=1.0)
    force_include_usage: bool = False
    parallel_tool_calls: bool = Field(
        True, description="default when a request does not say (OpenAI's: true); the grammar allows each "
                          "tool at most once per turn")
    lazy_tool_grammar: bool = Field(
        True, description="tool_choice auto: constrain a call once the model writes <tool_call>; free text "
                          "may not echo the prompt's tool markup (off: free output, parsed afterwards)")

    # speculation defaults (a request's `speculation` object overrides them); defaults, bounds and
    # help come from whiflash_core.config.SpeculationConfig
    speculation_method: Method | None = Field(
        None, description="None: the best method the loaded drafters allow")
    speculation_alpha: float = Field(**speculation_field("alpha"))
    num_draft_tokens: int | None = Field(**speculation_field("num_draft_tokens"))
    block_size: int | None = Field(**speculation_field("block_size"))
    prompt_lookup: bool = Field(**speculation_field("prompt_lookup"))

    def speculation(self, method: str) -> SpeculationConfig:
        """The server's default speculation settings for `method`."""
        return SpeculationConfig(method=method, alpha=self.speculation_alpha, num_draft_tokens=self.num_draft_tokens,
                                 block_size=self.block_size, prompt_lookup=self.prompt_lookup)

    @property
    def api_keys(self) -> list[str]:
        """The API keys (`--api-key k1,k2`, as llama.cpp's); empty when the API is open."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    def engine_threads(self, default: int) -> tuple[int, int]:
        """(threads, step_threads) of one engine: `threads` or `default`, and `step_threads` or one fewer."""
        threads = self.threads or default
        return threads, self.step_threads or max(1, threads - 1)

    @field_validator("cors_origins", "model_aliases", mode="before")
    @classmethod
    def _split_origins(cls, value):
        # WHIFLASH_CORS_ORIGINS="http://a,http://b" (WHIFLASH_MODEL_ALIASES="a,b") as well as a list from the CLI
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value


class ReplicaSettings(BaseSettings):
    """Scale-out settings (`WHIFLASH_<NAME>` or the `whiflash serve` flags of the same names)."""
    model_config = SettingsConfigDict(env_prefix="WHIFLASH_", extra="ignore")

    replicas: int = Field(1, ge=1, description="engine replicas behind one endpoint (1: the single-process "
                                               "server, no Ray)")
    gpus_per_replica: float | None = Field(None, ge=0, description="GPUs reserved per replica (default: 1 when "
                                                                   "serving on cuda, else 0)")
    ray_address: str | None = Field(None, description="an existing Ray cluster to deploy on (default: start a "
                                                      "local one, shut down with the server)")
    health_check_period_s: float = Field(2.0, gt=0, description="how often Ray Serve checks each replica "
                                                                "(a dead one is replaced)")

"""What `cmpchat serve` can be told: the address, the concurrency, the limits and the defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from cmpchat.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    """Address to listen on; loopback unless the user asks otherwise."""
    port: int = 8080
    slots: int = 4
    """Sequences generated together (continuous batching)."""
    max_queue: int = 64
    """Requests that may wait for a slot; beyond that the server answers 503."""
    api_key: str | None = None
    """When set, every route but /health and /v1/health needs `Authorization: Bearer <api_key>` (or
    `X-Api-Key: <api_key>`)."""
    max_request_bytes: int = 8 * 2**20
    """Largest request body accepted (413 above)."""
    default_max_tokens: int = 4096
    """Token limit of a chat reply whose request sets none (the context length bounds it too)."""
    default_completion_max_tokens: int = 16
    """Token limit of a /v1/completions request that sets none (OpenAI's default)."""
    prefill_chunk: int = 512
    """Prompt tokens processed per engine step; also where prompt states are saved for reuse."""
    prefix_cache_entries: int = 16
    """Saved sequence states kept for prefix reuse (0 turns reuse off)."""
    model_name: str | None = None
    """The model id clients see; by default the model file's name without `.gguf`."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the API (CORS); none by default."""
    allow_remote_images: bool = False
    """Fetch images given by http(s) URL (else only data URIs are read): the server then makes requests to
    whatever addresses its clients name."""
    shutdown_grace_seconds: float = 3.0
    """After SIGTERM or Ctrl+C, how long requests in flight may run on before they are ended (a 503, or a
    stream's error event and [DONE])."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.7, top_p=0.8, top_k=20))
    """Sampling for the fields a request leaves out (Qwen's recommended settings)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        for name in ("slots", "max_request_bytes", "default_max_tokens", "default_completion_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if not self.shutdown_grace_seconds >= 0:
            raise ValueError("shutdown_grace_seconds must be >= 0")
        if self.max_queue < 0 or self.prefix_cache_entries < 0:
            raise ValueError("max_queue and prefix_cache_entries must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")

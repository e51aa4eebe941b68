"""Continuous batching for serving many requests at once: a scheduler, a prefix cache of saved sequence
states, and the engine that drives a backend through them (nano-vllm's engine/scheduler split)."""

from cmpchat.generation.scheduling.engine import BatchEngine
from cmpchat.generation.scheduling.prefix_cache import PrefixCache, PrefixHit
from cmpchat.generation.scheduling.request import (
    EngineEvent,
    EngineStopped,
    EventSink,
    Failed,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    Started,
)
from cmpchat.generation.scheduling.stats import EngineStats

__all__ = [
    "BatchEngine",
    "EngineEvent",
    "EngineStats",
    "EngineStopped",
    "EventSink",
    "Failed",
    "GenerationRequest",
    "PrefixCache",
    "PrefixHit",
    "QueueFull",
    "RequestHandle",
    "Started",
]

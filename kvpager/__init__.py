"""kvpager: an LLM inference engine that manages the KV cache like an operating system manages RAM.

`from kvpager import LLM, SamplingParams` is the offline API. The names are imported lazily so the
torch-free core (config, kv pool, scheduler, planner) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]

if TYPE_CHECKING:
    from kvpager.api.llm import LLM
    from kvpager.core.config import EngineConfig
    from kvpager.core.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvpager.api.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpager.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from kvpager.core.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'kvpager' has no attribute {name!r}")

"""The OpenAI-compatible HTTP server of `kvpager serve` (FastAPI + uvicorn)."""

from kvpager.api.server.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]

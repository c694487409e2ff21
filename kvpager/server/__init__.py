"""The OpenAI-compatible HTTP server of `kvpager serve` (FastAPI + uvicorn)."""

from kvpager.server.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]

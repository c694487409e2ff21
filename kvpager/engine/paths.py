"""Where bundled files live."""

from __future__ import annotations

from pathlib import Path


def demo_model_dir() -> Path:
    """The bundled demo model (a small Llama trained on the King James Bible)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def resolve_model_dir(model: str | None) -> Path:
    """`None` means the bundled demo model; anything else is a checkpoint directory."""
    return demo_model_dir() if model is None else Path(model).expanduser()

"""The package's folders are the architecture's layers: imports point down only (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpager

ROOT = Path(kvpager.__file__).resolve().parent

# rank of each top-level package; a module may import its own package or a lower rank only
LAYERS: dict[str, int] = {
    "core": 0,
    "gguf": 0,  # GGUF file reading and metadata (numpy + the gguf package): the planner and text read it
    "planner": 1,
    "text": 1,
    "model": 2,
    "kvstore": 3,
    "worker": 3,
    "engine": 4,
    "api": 5,
    "bench": 5,
    "cli": 6,
}
TORCH_FREE = ("core", "gguf", "planner")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvpager" and parts[1] in LAYERS else None


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in the file, including ones inside functions."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _modules() -> list[tuple[str, Path]]:
    return [
        (p.relative_to(ROOT).parts[0], p) for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] in LAYERS
    ]


def test_every_top_level_package_has_a_layer() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), f"give {sorted(packages - set(LAYERS))} a layer in this test and the docs"


def test_no_module_imports_a_higher_layer() -> None:
    wrong = []
    for layer, path in _modules():
        for module, line in _imports(path):
            target = _layer(module)
            if target is not None and target != layer and LAYERS[target] >= LAYERS[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {module} ({target})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(set(wrong)))


def test_the_core_and_the_planner_import_no_torch() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for layer, path in _modules()
        if layer in TORCH_FREE
        for module, line in _imports(path)
        if module.split(".")[0] in ("torch", "transformers")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvpager.engine.engine import Engine\n")
    assert [_layer(m) for m, _ in _imports(bad)] == ["engine", "engine"]

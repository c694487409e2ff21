"""Every file the kernels compile from is package data, so a non-editable install can build them."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from kvpager.model.backends import quant_kernels
from kvpager.model.backends.kernels import build

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_and_include_matches_a_package_data_pattern() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvpager"]
    package = ROOT / "kvpager"
    files = {*build.SOURCES, *build.HEADERS, *quant_kernels.SOURCES, *quant_kernels.INCLUDES}
    # every file the sources include, found by name in the kernel folder (quant_dot_gemm.inc among them)
    files |= {p for p in build.KERNEL_DIR.iterdir() if p.suffix in (".cpp", ".h", ".inc")}
    missing = [
        str(f.relative_to(package))
        for f in sorted(files)
        if not any(fnmatch.fnmatch(str(f.relative_to(package)), pattern) for pattern in patterns)
    ]
    assert not missing, f"kernel files a wheel would leave out: {missing}"

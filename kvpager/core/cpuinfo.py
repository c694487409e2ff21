"""Reading /proc/cpuinfo (torch-free): the fields of its first processor entry."""

from __future__ import annotations

from pathlib import Path

PROC_CPUINFO = Path("/proc/cpuinfo")


def read_cpuinfo(path: Path = PROC_CPUINFO) -> dict[str, str]:
    """`path`'s first processor entry as {field: value} (the first value where a field repeats); empty
    where the file cannot be read (not Linux)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's entry is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields

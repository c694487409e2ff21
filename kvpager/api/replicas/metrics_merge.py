"""One Prometheus page from several replicas' pages: every sample gains a `replica` label.

Each replica renders its own `/metrics` (the same names); concatenating them would repeat HELP/TYPE
lines and make samples ambiguous, so the pages are parsed and re-rendered with the label added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def merge_pages(pages: Sequence[tuple[str, str]], roles: Mapping[str, str] | None = None) -> str:
    """`pages` = (replica label, Prometheus text) pairs; the merged text exposition.

    `roles` (replica label -> role) adds a `role` label too: an application with a prefill pool.
    """
    from prometheus_client.parser import text_string_to_metric_families

    helps: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in pages:
        for family in text_string_to_metric_families(text):
            helps.setdefault(family.name, (family.documentation, family.type))
            lines = samples.setdefault(family.name, [])
            for sample in family.samples:
                labels = {"replica": replica, **sample.labels}
                if roles is not None and replica in roles:
                    labels = {"replica": replica, "role": roles[replica], **sample.labels}
                rendered = ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")
    out: list[str] = []
    for name, (documentation, kind) in helps.items():
        out.append(f"# HELP {name} {_escape(documentation)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples[name])
    return "\n".join(out) + "\n"

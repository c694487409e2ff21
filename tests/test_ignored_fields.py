"""Ignored request fields are reported safely: any name a client sends fits a header and a log line."""

from __future__ import annotations

from kvpager.api.server.fields import MAX_LOGGED_FIELDS, MAX_REPORTED_FIELDS, FieldReporter, printable_name
from kvpager.api.server.protocol import CompletionRequest


def test_names_with_surrogates_controls_and_commas_become_printable_ascii() -> None:
    for name in ["a\ud800b", "x\r\nSet-Cookie: y", "a,b", "\u00b7\u0015\u00d6", "q" * 500]:
        shown = printable_name(name)
        shown.encode("latin-1")  # a header value must encode (a lone surrogate used to give a 500)
        assert all(0x20 <= ord(c) < 0x7F for c in shown) and "," not in shown
        assert len(shown) <= 6 * 64


def test_the_header_lists_the_ignored_fields_and_the_log_stays_bounded() -> None:
    reporter = FieldReporter()
    # the field name schemathesis found: non-Latin-1 characters and a control (the header raised, a 500)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "\u00b7\u0015\U0001f600odd": 1, "guided_x": 2})
    header = reporter.check(req)["x-kvpager-ignored-fields"]
    header.encode("latin-1")
    assert "guided_x" in header and "\\u00b7\\u0015\\ud83d\\ude00odd" in header
    for i in range(3):  # a client inventing names cannot grow the logged set without bound
        many = {f"f{i}_{j}": 0 for j in range(MAX_LOGGED_FIELDS)}
        reporter.check(CompletionRequest.model_validate({"model": "m", "prompt": "x", **many}))
    assert len(reporter._logged) <= MAX_LOGGED_FIELDS
    wide = CompletionRequest.model_validate({"model": "m", "prompt": "x", **{f"z{j}": 0 for j in range(100)}})
    assert len(reporter.check(wide)["x-kvpager-ignored-fields"].split(",")) == MAX_REPORTED_FIELDS

"""Tool-call parsers for tool_choice "auto" (vLLM's names) and the request-field reporter."""

from __future__ import annotations

import json

import pytest

from kvpager.api.server.errors import ApiError
from kvpager.api.server.fields import refuse_unsupported, unknown_fields
from kvpager.api.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpager.api.server.tools import held_back, parse_tool_calls


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ],
)
def test_each_parser_finds_the_call_and_its_arguments(parser: str, text: str) -> None:
    content, calls = parse_tool_calls(parser, text)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")
    assert content == ("Let me look." if parser == "hermes" else None)


def test_several_calls_and_plain_text_and_broken_calls() -> None:
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert [c.function.name for c in parse_tool_calls("hermes", two)[1]] == ["a", "b"]
    semi = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c.function.name for c in parse_tool_calls("llama3_json", semi)[1]] == ["a", "b"]
    assert parse_tool_calls("hermes", "just words") == ("just words", [])
    assert parse_tool_calls("hermes", "<tool_call>{not json") == ("<tool_call>{not json", [])


def test_streamed_content_holds_back_a_possible_marker_prefix() -> None:
    assert held_back("hermes", "hello <tool_") == len("<tool_")
    assert held_back("hermes", "hello <b>") == 0
    assert held_back("mistral", "ok [TOOL") == len("[TOOL")


def test_unknown_fields_are_listed_with_their_path_and_result_changing_ones_refused() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "cache_hint": 1}], "frobnicate": True, "store": False}
    )
    assert unknown_fields(req) == ["frobnicate", "messages[].cache_hint", "store"]
    refuse_unsupported(req)  # ignored, not refused
    with pytest.raises(ApiError) as err:
        refuse_unsupported(CompletionRequest.model_validate({"prompt": "x", "best_of": 3}))
    assert err.value.status == 400 and err.value.param == "best_of"
    refuse_unsupported(CompletionRequest.model_validate({"prompt": "x", "best_of": 1}))  # best_of == n


def test_required_array_cut_short_keeps_its_complete_calls() -> None:
    from kvpager.api.server.tools import complete_items

    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"x": 7}}, {"name": "GetWea'
    assert [i["name"] for i in complete_items(cut)] == ["a", "b"]
    assert complete_items('[{"na') == [] and complete_items("not an array") == []


def test_strict_schemas_close_every_object_that_lists_properties() -> None:
    from kvpager.api.server.guided import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "properties": {"type": "string"},
        },
        "$defs": {"D": {"type": "object", "properties": {"y": {}}, "additionalProperties": True}},
        "items": {"anyOf": [{"type": "object", "properties": {"z": {}}}]},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]  # a property named "properties"
    assert closed["$defs"]["D"]["additionalProperties"] is True  # an explicit choice is kept
    assert closed["items"]["anyOf"][0]["additionalProperties"] is False

"""The structured-output constraint of a request: OpenAI's `response_format` or vLLM's extras.

Exactly one of `response_format` (json_object / json_schema), `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` or `structured_outputs` may constrain a request; two are a 400.
The result is a torch-free `StructuredOutputSpec`; the engine's grammar compiler turns it into
token masks (and answers 400 when it does not compile).
"""

from __future__ import annotations

import json
from typing import Any

from kvpager.api.server.errors import ApiError
from kvpager.api.server.protocol import _SamplingFields
from kvpager.core.sampling_params import StructuredOutputSpec

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists properties and does
    not say otherwise (OpenAI's strict mode; tool arguments): a model cannot invent extra keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def schema_text(schema: str | dict[str, Any], param: str, strict: bool = False) -> str:
    """The schema serialised (sorted keys: one cache entry per schema); 400 when it is not an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    return json.dumps(closed_objects(schema) if strict else schema, sort_keys=True)


def structured_spec(req: _SamplingFields) -> StructuredOutputSpec | None:
    """The request's constraint, or None; 400 when it sends more than one or a malformed one."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        strict = bool(fmt.json_schema.strict)
        text = schema_text(fmt.json_schema.schema_, "response_format", strict)
        found.append(("response_format", StructuredOutputSpec("json", text)))
    if req.guided_json is not None:
        found.append(("guided_json", StructuredOutputSpec("json", schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputSpec("grammar", req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(("structured_outputs.json", StructuredOutputSpec("json", schema_text(so.json_, "json"))))
        if so.regex is not None:
            found.append(("structured_outputs.regex", StructuredOutputSpec("regex", so.regex)))
        if so.choice is not None:
            found.append(("structured_outputs.choice", _choice(so.choice, "structured_outputs.choice")))
        if so.grammar is not None:
            found.append(("structured_outputs.grammar", StructuredOutputSpec("grammar", so.grammar)))
        if so.json_object:
            found.append(("structured_outputs.json_object", StructuredOutputSpec("json_object")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"send at most one structured-output constraint, got {names}", param=found[1][0])
    return found[0][1] if found else None


def _choice(choices: list[str], param: str) -> StructuredOutputSpec:
    if not choices or not all(choices):
        raise ApiError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
    return StructuredOutputSpec("choice", json.dumps(choices))

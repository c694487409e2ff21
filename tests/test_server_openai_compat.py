"""The OpenAI API as real clients use it, against a real `kvpager serve` of the bundled demo model.

Checked with the unmodified `openai` SDK and with the exact request shapes of lm-eval's
`local-completions` (loglikelihood: echo + logprobs=1 + max_tokens=1, prompts as token ids):
prompt logprobs against transformers' log_softmax on the same weights, logit_bias, structured
output (`.parse()` with a pydantic model), tools (named / required, streamed and reassembled by
the SDK), unknown-field reporting, models.retrieve, /tokenizer_info and the vLLM metric names.
One server serves the whole module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field
from server_harness import ServerProcess, launch_server

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "kvpager" / "demo_model"
TEMPLATE = Path(__file__).resolve().parent / "data" / "chatml_tools.jinja"
PROMPT = "And God said, Let there be light: and there was light."
CONTINUATION = " And God saw the light, that it was good."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = launch_server(
        DEMO_DIR,
        tmp_path_factory.mktemp("compat_logs"),
        "--kv-cache-memory",
        "16MiB",
        "--served-model-name",
        "demo",
        "demo-alias",
        "--chat-template",
        str(TEMPLATE),
        "--tool-call-parser",
        "hermes",
        # small steps: the scored prompts (~25 tokens) are prefilled in chunks, so prompt logprobs
        # are gathered across steps
        "--max-num-batched-tokens",
        "16",
    )
    try:
        yield proc.wait_healthy(timeout=300)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()


def tokenize(server: ServerProcess, text: str, special: bool = True) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": special}, timeout=30)
    return list(r.json()["tokens"])


def hf_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_lm_eval_loglikelihood_request_scores_like_transformers_also_on_a_prefix_cache_hit(
    server: ServerProcess, hf_model: Any
) -> None:
    context = tokenize(server, PROMPT)
    full = context + tokenize(server, CONTINUATION, special=False)
    # The payload of lm-eval's LocalCompletionsAPI._create_payload(generate=False), tokenized requests.
    body = {
        "model": "demo",
        "prompt": [full],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    want = hf_logprobs(hf_model, full)
    results = []
    for _ in range(2):  # the second request finds the prompt's blocks in the prefix cache
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(full) + 1 and token_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(token_logprobs[1 : len(full)], want, strict=True)) < 1e-4
        # lm-eval's parse_logprobs: the continuation's sum and whether each token was the top one.
        results.append(sum(token_logprobs[len(context) : -1]))
        tops = choice["logprobs"]["top_logprobs"][len(context) : -1]
        assert all(len(top) >= 1 for top in tops)
    assert results[0] == results[1]
    assert abs(results[0] - sum(want[len(context) - 1 :])) < 1e-4
    cached = httpx.post(f"{server.url}/v1/completions", json={"prompt": [full], "max_tokens": 1}, timeout=60)
    assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the blocks were there


def test_max_tokens_0_with_echo_scores_the_prompt_and_prompt_logprobs_has_vllm_shape(
    server: ServerProcess, hf_model: Any
) -> None:
    ids = tokenize(server, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert choice["text"] == PROMPT and data["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    prompt_lp = choice["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    want = hf_logprobs(hf_model, ids)
    for i, entry in enumerate(prompt_lp[1:], start=1):
        assert abs(entry[str(ids[i])]["logprob"] - want[i - 1]) < 1e-4
        assert 1 <= len(entry) <= 3 and entry[str(ids[i])]["rank"] >= 1
    err = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert err.status_code == 400 and err.json()["error"]["param"] == "max_tokens"


def test_logit_bias_plus_100_forces_a_token_and_minus_100_forbids_it_on_both_endpoints(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    forced = tokenize(server, " LORD", special=False)
    assert len(forced) == 1
    resp = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(forced[0]): 100}
    )
    assert resp.choices[0].text == " LORD" * 4
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced[0]): 100},
    )
    assert chat.choices[0].message.content == " LORD" * 3
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]  # type: ignore[union-attr]
    first_id = tokenize(server, first, special=False)
    assert len(first_id) == 1
    banned = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first_id[0]): -100}
    )
    assert banned.choices[0].text not in ("", first)


class Verse(BaseModel):
    book: Literal["Genesis", "Exodus", "Psalms"]
    chapter: int = Field(ge=1, le=150)
    words: str = Field(max_length=40)


def test_sdk_parse_with_a_pydantic_model_returns_a_validated_object_from_the_demo_model(client: openai.OpenAI) -> None:
    resp = client.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "Quote a verse."}],
        response_format=Verse,
        max_tokens=120,
        seed=1,
    )
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Verse)


def test_guided_choice_regex_and_json_object_constrain_completions(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=10, extra_body={"guided_choice": ["Jerusalem", "Egypt"]}
    )
    assert choice.choices[0].text in ("Jerusalem", "Egypt")
    regex = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=12, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}
    )
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    so = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=12, extra_body={"structured_outputs": {"choice": ["yea", "nay"]}}
    )
    assert so.choices[0].text in ("yea", "nay")


def test_invalid_schema_and_two_constraints_are_400(server: ServerProcess) -> None:
    bad = {"prompt": "x", "guided_json": {"type": "nonsense"}}
    r = httpx.post(f"{server.url}/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "json" in r.json()["error"]["message"]
    two = {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
    r = httpx.post(f"{server.url}/v1/completions", json=two, timeout=60)
    assert r.status_code == 400 and "guided_choice" in r.json()["error"]["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Jerusalem", "Babylon"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Jerusalem?"}]


def _valid_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Jerusalem", "Babylon") and 1 <= args["days"] <= 7


def test_named_and_required_tool_choice_return_schema_valid_tool_calls(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    msg = named.choices[0].message
    assert named.choices[0].finish_reason == "tool_calls" and msg.tool_calls and msg.tool_calls[0].id
    assert msg.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    _valid_weather(msg.tool_calls[0].function.arguments)  # type: ignore[union-attr]
    required = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        parallel_tool_calls=False,
    )
    calls = required.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    _valid_weather(calls[0].function.arguments)  # type: ignore[union-attr]


def test_streamed_tool_call_reassembles_in_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="demo", messages=MESSAGES, tools=[WEATHER], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and call.id  # type: ignore[union-attr]
    _valid_weather(call.function.arguments)  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tools_and_tool_results_reach_the_chat_template(client: openai.OpenAI, server: ServerProcess) -> None:
    from kvpager.text.tokenizer import Tokenizer, render_chat_template

    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Jerusalem", "days": 1}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hot and dry"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model="demo", messages=history, tools=[WEATHER], tool_choice="auto", max_tokens=2
    )
    tok = Tokenizer.from_dir(DEMO_DIR)
    for m in history:
        if m.get("tool_calls"):
            m["tool_calls"][0]["function"]["arguments"] = {"city": "Jerusalem", "days": 1}
    text = render_chat_template(TEMPLATE.read_text(), history, tools=[WEATHER], specials=tok.specials)
    assert "hot and dry" in text and "get_weather" in text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_unknown_fields_are_reported_and_result_changing_ones_refused(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 1}, timeout=60)
    assert r.status_code == 200 and r.headers["x-kvpager-ignored-fields"] == "frobnicate"
    assert "frobnicate" in server.log()  # logged once by name
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 1, "best_of": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_models_retrieve_aliases_created_and_tokenizer_info(client: openai.OpenAI, server: ServerProcess) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == ["demo", "demo-alias"]
    card = client.models.retrieve("demo-alias")
    assert card.id == "demo-alias" and card.created == listed[0].created
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert client.completions.create(model="demo-alias", prompt="x", max_tokens=1).model == "demo-alias"
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE.read_text()


def test_metrics_parse_and_carry_the_vllm_names(server: ServerProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions", "kvpager:num_requests_running",
    ):  # fmt: skip
        assert name in families, name
    success = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert any(s.labels["finished_reason"] == "length" and s.value >= 1 for s in success)
    assert all(s.labels["model_name"] == "demo" and s.labels["engine"] == "0" for s in success)


MC_DOCS = [
    {
        "question": "In the beginning God created the heaven and the",
        "choices": [" earth.", " sea.", " city."],
        "answer": 0,
    },
    {"question": "And God said, Let there be", "choices": [" light:", " darkness:"], "answer": 0},
]
MC_TASK = """task: kvpager_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_multiple_choice_matches_transformers(
    server: ServerProcess, hf_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval itself (remote tokenizer found through /tokenizer_info) on a local jsonl task."""
    from transformers import AutoTokenizer

    for var, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "EMPTY"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "task.yaml").write_text(MC_TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "demo", "base_url": f"{server.url}/v1/completions", "num_concurrent": 1, "max_retries": 1},
        tasks=["kvpager_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert results is not None
    tok = AutoTokenizer.from_pretrained(DEMO_DIR)
    samples = results["samples"]["kvpager_tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = tok.encode(context, add_special_tokens=False)
            full = tok.encode(context + continuation, add_special_tokens=False)
            want = sum(hf_logprobs(hf_model, full)[len(ctx) - 1 :])
            assert abs(resp[0][0] - want) < 1e-4


def test_langchain_structured_output_and_bound_tools_return_parsed_objects(server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    class GetWeather(BaseModel):
        """Weather of a city."""

        city: Literal["Jerusalem", "Babylon"]
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="demo", max_tokens=100, max_retries=0)  # type: ignore[arg-type]
    verse = llm.with_structured_output(Verse).invoke("Quote a verse.")
    assert isinstance(verse, Verse)
    message = llm.bind_tools([GetWeather], tool_choice="required").invoke("Weather in Jerusalem?")
    calls = message.tool_calls  # type: ignore[attr-defined]
    assert calls and all(c["name"] == "GetWeather" for c in calls)  # parallel calls are allowed
    for call in calls:
        GetWeather.model_validate(call["args"])

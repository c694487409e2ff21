"""The bundled demo model (kvpager/demo_model) is a standard HF Llama checkpoint that speaks KJV.

These tests load the committed files with transformers (the reference implementation), so they pin
the checkpoint itself; kvpager's own engine is tested against the same files elsewhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.slow  # the demo model against transformers


DEMO_DIR = Path(__file__).resolve().parent.parent / "kvpager" / "demo_model"
MAX_TOTAL_BYTES = 25 * 1024 * 1024
KJV_WORDS = ("the", "and", "of", "LORD", "God", "unto", "earth", "heaven")
# Genesis 40:1-8 (KJV, public domain). Chapter 39 (0-based) is held out of training by
# scripts/train_demo_model.py (every 40th chapter), so this text was never trained on.
HELD_OUT_PASSAGE = (
    "And it came to pass after these things, that the butler of the king of Egypt and his baker had"
    " offended their lord the king of Egypt.\n"
    "And Pharaoh was wroth against two of his officers, against the chief of the butlers, and against"
    " the chief of the bakers.\n"
    "And he put them in ward in the house of the captain of the guard, into the prison, the place where"
    " Joseph was bound.\n"
    "And the captain of the guard charged Joseph with them, and he served them: and they continued a"
    " season in ward.\n"
    "And they dreamed a dream both of them, each man his dream in one night, each man according to the"
    " interpretation of his dream, the butler and the baker of the king of Egypt, which were bound in"
    " the prison.\n"
    "And Joseph came in unto them in the morning, and looked upon them, and, behold, they were sad.\n"
    "And he asked Pharaoh's officers that were with him in the ward of his lord's house, saying,"
    " Wherefore look ye so sadly to day?\n"
    "And they said unto him, We have dreamed a dream, and there is no interpreter of it. And Joseph said"
    " unto them, Do not interpretations belong to God? tell me them, I pray you.\n"
)
# NOTE: the committed model scores perplexity ~61 on this passage; a unigram model fitted to the
# training text scores ~305 and uniform guessing 4096. The bound keeps a 2.5x margin while still
# requiring the model to use context (half the unigram perplexity).
MAX_HELD_OUT_PERPLEXITY = 150.0


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return json.loads((DEMO_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_DIR)


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(DEMO_DIR).eval()


def test_checkpoint_files_exist_and_fit_the_size_budget() -> None:
    names = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "LICENSE",
    ]
    for name in names:
        assert (DEMO_DIR / name).is_file(), f"missing {name}"
    total = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert total <= MAX_TOTAL_BYTES


def test_config_is_a_standard_fp32_llama_with_gqa_and_tied_embeddings(config: dict[str, Any]) -> None:
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] in (512, 1024)
    assert config["bos_token_id"] == 0 and config["eos_token_id"] == 0


def test_safetensors_holds_fp32_tensors_under_hf_llama_names(config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    per_layer = [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{name}.weight" for name in per_layer}
    with safe_open(str(DEMO_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(name).dtype for name in names}
        kv_rows = f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape[0]
    assert names == expected  # tied: no separate lm_head.weight
    assert dtypes == {torch.float32}
    assert kv_rows == config["num_key_value_heads"] * config["head_dim"]


def test_parameter_count_is_between_2m_and_20m(model: Any) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 <= num_params <= 20_000_000


def test_tokenizer_is_byte_level_with_chatml_special_tokens(tokenizer: Any, config: dict[str, Any]) -> None:
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    text = "Naïve café — ☃ 𝄞 and the LORD"  # bytes never seen in the corpus still round-trip
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_chat_template_renders_chatml_with_a_generation_prompt(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made light?"}]
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho made light?<|im_end|>\n"
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_greedy_continuation_of_genesis_opening_is_kjv_like(model: Any, tokenizer: Any) -> None:
    prompt = "In the beginning God created"
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    continuation = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = set(continuation.replace(",", " ").replace(".", " ").replace(":", " ").split())
    assert len(words & set(KJV_WORDS)) >= 2, continuation


def test_held_out_passage_perplexity_is_far_below_uniform(model: Any, tokenizer: Any) -> None:
    ids = torch.tensor([[0] + tokenizer.encode(HELD_OUT_PASSAGE, add_special_tokens=False)])  # [1, T]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    perplexity = math.exp(loss)
    assert perplexity < MAX_HELD_OUT_PERPLEXITY < 0.1 * len(tokenizer)


def test_kvpager_generate_on_the_demo_model_continues_like_the_corpus_and_matches_transformers(
    model: Any, tokenizer: Any
) -> None:
    from kvpager.api.llm import LLM
    from kvpager.core.sampling_params import SamplingParams

    prompt = "And the LORD spake unto Moses, saying,"
    llm = LLM(kv_cache_memory=16 << 20)  # no model: the bundled demo model
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert ours.token_ids == ref[: len(ours.token_ids)]
    words = set(ours.text.replace(",", " ").replace(";", " ").replace(".", " ").split())
    assert len(words & {"unto", "children", "Israel", "LORD", "say", "saith", "them", "the"}) >= 3, ours.text

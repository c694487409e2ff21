#!/usr/bin/env python3
"""Train kvpager's bundled demo model: a ~4M-parameter Llama on the King James Bible.

The corpus comes from Debian's ``bible-kjv`` package (public domain text); the script calls the
``bible`` command itself. It trains a byte-level BPE tokenizer, then a small Llama (GQA, tied
embeddings) with a plain torch loop, and writes a standard Hugging Face checkpoint:
config.json, model.safetensors (fp32), generation_config.json, tokenizer.json, tokenizer_config.json.

Reproducible: fixed seeds and a deterministic data order. The learning-rate schedule follows
``max(step / steps, elapsed / max_minutes)``, so the cosine always completes; the run is exactly
repeatable (up to float summation order across thread counts) when the step limit binds.

    python scripts/train_demo_model.py --out kvpager/demo_model --steps 600 --max-minutes 22
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2
BIBLE_RANGE = "Gen1:1-Rev22:21"
INSTALL_HINT = "sudo apt-get update && sudo apt-get install -y bible-kjv"
# NOTE: every VAL_EVERY-th chapter (0-based index % VAL_EVERY == VAL_EVERY - 1) is held out from
# both the tokenizer and the model; chapter 39 is Genesis 40 (the butler and the baker).
VAL_EVERY = 40
VERSE_RE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TrainArgs:
    """Command-line settings of one training run."""

    out: Path
    steps: int
    max_minutes: float
    batch_size: int
    seq_len: int
    vocab_size: int
    lr: float
    seed: int
    threads: int
    eval_every: int


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """Parse the command line into a TrainArgs."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kvpager/demo_model"), help="output directory")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (upper limit)")
    p.add_argument("--max-minutes", type=float, default=20.0, help="wall-clock limit for the training loop")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation estimates")
    a = p.parse_args(argv)
    if a.steps < 1 or a.max_minutes <= 0 or a.batch_size < 1 or a.seq_len < 8:
        p.error("--steps, --max-minutes and --batch-size must be positive and --seq-len at least 8")
    return TrainArgs(**{k: v for k, v in vars(a).items()})


def fetch_chapters() -> list[str]:
    """Run `bible` and return the KJV as one string per chapter (verse references stripped)."""
    if shutil.which("bible") is None:
        sys.exit(f"error: the `bible` command is missing. Install the corpus with:\n    {INSTALL_HINT}")
    raw = subprocess.run(["bible", "-f", BIBLE_RANGE], check=True, capture_output=True, text=True).stdout
    chapters: list[list[str]] = []
    last_key: tuple[str, str] | None = None
    for line in raw.splitlines():
        m = VERSE_RE.match(line)
        if m is None:
            raise ValueError(f"unexpected `bible` output line {line[:60]!r}; expected 'Ge1:1 text'")
        key = (m["book"], m["chapter"])
        if key != last_key:
            chapters.append([])
            last_key = key
        chapters[-1].append(m["text"].strip())
    # NOTE: one verse per line, references dropped; chapters are separate documents joined by EOT.
    return ["\n".join(verses) + "\n" for verses in chapters]


def split_chapters(chapters: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic train/validation split by chapter index."""
    train = [c for i, c in enumerate(chapters) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [c for i, c in enumerate(chapters) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with the three special tokens at ids 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenate documents as [EOT, doc, EOT, doc, ...] into one int64 token array."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def build_model(vocab_size: int, seed: int) -> torch.nn.Module:
    """The demo Llama: hidden 256, 4 layers, 4 query heads, 2 KV heads (GQA), tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


class Batches:
    """Deterministic epochs of non-overlapping windows; each epoch shifts the grid and reshuffles."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []

    def _refill(self) -> None:
        shift = int(self.rng.integers(0, self.seq_len))
        starts = np.arange(shift, len(self.tokens) - self.seq_len - 1, self.seq_len)
        self.order = self.rng.permutation(starts).tolist()

    def next(self) -> torch.Tensor:
        """Return a [batch_size, seq_len + 1] int64 batch (inputs and shifted targets)."""
        rows = []
        for _ in range(self.batch_size):
            if not self.order:
                self._refill()
            s = self.order.pop()
            rows.append(self.tokens[s : s + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, L+1] batch."""
    logits = model(input_ids=batch[:, :-1]).logits  # [B, L, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, max_windows: int | None) -> float:
    """Mean loss over consecutive windows of `tokens` (all of them when max_windows is None)."""
    model.eval()
    starts = list(range(0, len(tokens) - seq_len - 1, seq_len))[:max_windows]
    total, count = 0.0, 0
    for i in range(0, len(starts), 32):
        batch = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts[i : i + 32]]))
        total += lm_loss(model, batch).item() * len(batch)
        count += len(batch)
    model.train()
    return total / count


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to floor * peak; progress in [0, 1]."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def train(model: torch.nn.Module, data: Batches, val: np.ndarray, args: TrainArgs) -> dict[str, float | int | str]:
    """Run the training loop; returns summary numbers for the report."""
    opt = make_optimizer(model, args.lr)
    budget_s = args.max_minutes * 60.0
    t0 = time.perf_counter()
    step, smooth = 0, None
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.steps, elapsed / budget_s)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, args.lr)
        loss = lm_loss(model, data.next())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % 10 == 0 or step == 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  smooth {smooth:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{elapsed / max(step - 1, 1):.2f}s/step  {elapsed / 60:.1f} min",
                flush=True,
            )
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val_loss(est) {evaluate(model, val, args.seq_len, 64):.4f}", flush=True)
    bound = "steps" if step >= args.steps else "max-minutes"
    return {
        "steps": step,
        "train_minutes": (time.perf_counter() - t0) / 60,
        "smooth_train_loss": smooth or 0.0,
        "limit": bound,
    }


def save_checkpoint(model: torch.nn.Module, tok: Tokenizer, out: Path) -> None:
    """Write a standard HF Llama checkpoint (fp32 safetensors, tied embeddings) plus tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    # NOTE: older readers look for top-level rope_theta/torch_dtype; transformers 5 writes
    # rope_parameters/dtype. Write both so any Llama loader reads the same values.
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0, "do_sample": False, "max_new_tokens": 64}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    for path in out.iterdir():
        path.chmod(0o644)


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    """tokenizer_config.json contents: special tokens and the ChatML chat template."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }


@torch.no_grad()
def sample(model: torch.nn.Module, tok: Tokenizer, prompt: str, new_tokens: int = 30) -> str:
    """Greedy continuation of `prompt` (no KV cache; fine for a few dozen tokens)."""
    model.eval()
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    for _ in range(new_tokens):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tok.decode(ids[0].tolist(), skip_special_tokens=False)


def main(argv: list[str] | None = None) -> None:
    """Fetch the corpus, train tokenizer and model, save, and print a summary."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    chapters = fetch_chapters()
    train_texts, val_texts = split_chapters(chapters)
    corpus_bytes = sum(len(c.encode()) for c in chapters)
    print(f"corpus: {len(chapters)} chapters, {corpus_bytes} bytes; val chapters: {len(val_texts)}", flush=True)
    tok = train_tokenizer(train_texts, args.vocab_size)
    train_ids, val_ids = encode_stream(tok, train_texts), encode_stream(tok, val_texts)
    print(f"tokens: train {len(train_ids)}, val {len(val_ids)}, vocab {tok.get_vocab_size()}", flush=True)
    model = build_model(tok.get_vocab_size(), args.seed)
    print(f"parameters: {sum(p.numel() for p in model.parameters())}", flush=True)
    summary = train(model, Batches(train_ids, args.seq_len, args.batch_size, args.seed), val_ids, args)
    summary["val_loss"] = evaluate(model, val_ids, args.seq_len, None)
    summary["train_loss_sample"] = evaluate(model, train_ids, args.seq_len, len(val_ids) // args.seq_len)
    save_checkpoint(model, tok, args.out)
    summary["total_minutes"] = (time.perf_counter() - t_start) / 60
    print(json.dumps(summary, indent=2))
    for prompt in ["In the beginning God created", "And God said", "And the LORD spake unto Moses, saying"]:
        print(repr(sample(model, tok, prompt)))


if __name__ == "__main__":
    main()

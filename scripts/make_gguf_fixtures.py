"""Make the committed GGUF test files (tests/data/gguf/) with llama.cpp's own tools.

    python scripts/make_gguf_fixtures.py --llama-cpp PATH/TO/llama.cpp [--out tests/data/gguf]

PATH/TO/llama.cpp is a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/) with its tools built
in build/bin (llama-quantize, llama-tokenize); BENCHMARKS.md says how to get and build one.

1. A tiny random-weight LlamaForCausalLM (tests/checkpoints.py; every matrix row a multiple of 256
   wide so llama.cpp's K-quants apply, each file well under 2 MB) with its byte-level BPE tokenizer.
2. llama.cpp's converter writes it as F32 and as Q8_0 (`--outtype q8_0`). The converter refuses a
   tokenizer whose pre-tokenizer hash it does not know; this tokenizer is GPT-2-style byte-level BPE,
   so `get_vocab_base_pre` is answered with "gpt-2" (the shared bench README's recipe). The
   converter imports `sentencepiece` (llama.cpp's requirements; `pip install sentencepiece`), on the
   PYTHONPATH you run this with.
3. llama-quantize makes Q4_0, Q4_K_M (a mix of Q4_K and Q6_K), Q5_K_M (Q5_K and Q6_K) and Q6_K from
   the F32 file (llama.cpp keeps some tensors at other types: the manifest records each tensor's).
4. llama-tokenize records the token ids of each file's tokenizer for a mixed English/Chinese/code
   text.
manifest.json lists the files (sha256, each tensor's ggml type and the counts, read back with the tree's
gguf-py) and the recorded ids. With
`--converter-only` (the tools not built yet) steps 3 and 4 are left out and the manifest says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog.\n"
    "你好，世界！分页缓存把键和值存进块里。\n"
    "def main():\n    return [x * 2 for x in range(10)]  # 42\n"
)
# Rows a multiple of 256 (K-quant super-blocks); 2 layers, GQA.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
QUANTIZED = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# The converter run in-process, with the tokenizer-hash answer patched in.
_CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # byte-level BPE, GPT-2 style
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree with build/bin tools")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf")
    parser.add_argument("--converter-only", action="store_true", help="skip llama-quantize and llama-tokenize")
    args = parser.parse_args(argv)
    llama = args.llama_cpp.resolve()
    tools = {name: llama / "build" / "bin" / name for name in ("llama-quantize", "llama-tokenize")}
    if not (llama / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{llama} has no convert_hf_to_gguf.py")
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing and not args.converter_only:
        parser.error(f"not built: {', '.join(missing)} (build llama.cpp, or pass --converter-only)")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_llama_checkpoint

    manifest: dict[str, object] = {"script": "scripts/make_gguf_fixtures.py", "text": TEXT, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_llama_checkpoint(Path(tmp) / "checkpoint", seed=7, **SHAPE)
        f32 = Path(tmp) / "tiny-llama-F32.gguf"
        convert(llama, checkpoint, f32, "f32")
        made = {"Q8_0": args.out / "tiny-llama-Q8_0.gguf"}
        convert(llama, checkpoint, made["Q8_0"], "q8_0")
        if not args.converter_only:
            for ftype in QUANTIZED:
                made[ftype] = args.out / f"tiny-llama-{ftype}.gguf"
                run([str(tools["llama-quantize"]), str(f32), str(made[ftype]), ftype])
        files: dict[str, object] = {}
        for ftype, path in made.items():
            entry: dict[str, object] = {
                "made_by": "convert_hf_to_gguf.py --outtype q8_0" if ftype == "Q8_0" else f"llama-quantize {ftype}",
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "bytes": path.stat().st_size,
                **tensor_types(llama, path),
            }
            if not args.converter_only:
                entry["llama_tokenize_ids"] = llama_tokenize(tools["llama-tokenize"], path)
            files[path.name] = entry
        manifest["files"] = files
        if args.converter_only:
            manifest["missing"] = "made with --converter-only: no llama-quantize files, no llama-tokenize ids"
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({name: e["bytes"] for name, e in files.items()}))  # type: ignore[index]
    return 0


def convert(llama: Path, checkpoint: Path, out: Path, outtype: str) -> None:
    paths = [str(llama), str(llama / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, "-c", _CONVERT, str(llama), str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
    run(cmd, env=env)


def tensor_types(llama: Path, model: Path) -> dict[str, object]:
    """The ggml type of every tensor of `model` and how many of each, read with the tree's gguf-py."""
    sys.path.insert(0, str(llama / "gguf-py"))
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(model).tensors}
    counts = {kind: list(types.values()).count(kind) for kind in sorted(set(types.values()))}
    return {"tensor_type_counts": counts, "tensor_types": dict(sorted(types.items()))}


def llama_tokenize(tool: Path, model: Path) -> list[int]:
    """llama-tokenize's ids for TEXT (with the BOS it adds when the file says so, as the engine does)."""
    out = run([str(tool), "-m", str(model), "-p", TEXT, "--ids", "--log-disable"])
    line = next(ln for ln in reversed(out.splitlines()) if ln.strip().startswith("["))
    return [int(t) for t in json.loads(line)]


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


if __name__ == "__main__":
    raise SystemExit(main())

"""Write a `--load-format dummy` model directory (config.json + placeholder tokenizer) for benchmarks.

    python scripts/make_dummy_model.py models/smollm2-135m                 # SmolLM2-135M's shape
    python scripts/make_dummy_model.py models/x --shape NAME               # any shape in kvpager.bench.dummy_models

The weights are drawn at load (`--load-format dummy`), so the directory is a few MB and nothing is
downloaded. `models/` is ignored by git.
"""

from __future__ import annotations

import argparse

from kvpager.bench.dummy_models import SHAPES, make_dummy_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    args = parser.parse_args()
    print(make_dummy_model_dir(args.directory, args.shape))


if __name__ == "__main__":
    main()

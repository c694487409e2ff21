"""GGUF files (llama.cpp's format), read with the `gguf` package. Torch-free: numpy only.

`reader` finds and opens the file(s) of a model (one file, a directory holding one, or split
`-00001-of-0000N.gguf` parts), `config` maps their metadata onto a Hugging Face config dict that
ModelSpec and the planner both parse. Tensors are turned into torch weights in kvpager/model/gguf_weights.py,
the tokenizer in kvpager/text/gguf_tokenizer.py.
"""

from kvpager.gguf.config import SUPPORTED_GGUF_ARCHITECTURES, hf_config_from_gguf
from kvpager.gguf.reader import GGUFError, GGUFModel, find_gguf_files, is_gguf_path, open_gguf

__all__ = [
    "GGUFError",
    "GGUFModel",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "find_gguf_files",
    "hf_config_from_gguf",
    "is_gguf_path",
    "open_gguf",
]

"""Text: tokenizers, chat templates and the incremental detokenizer."""

"""The engine: the step loop, its async wrapper, output processing, model loading and KV transfer (packs, export/import) through the one scheduler."""

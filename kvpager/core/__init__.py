"""The torch-free core: requests, the block pool and its hash chain, the KV cache manager, the scheduler, sizing and config. Imports nothing above it and no torch."""

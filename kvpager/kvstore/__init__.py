"""KV storage beneath the device pool: codecs, on-disk records, the pack file format, the host/disk tier chain and the offload worker."""

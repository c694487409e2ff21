"""KV tiers below the device pool: host RAM (bounded LRU) and disk (persistent, checksummed).

Policy (write-back): a cached block evicted from the device pool is offered to the host tier; what
the host tier evicts to make room spills to the disk tier; with no host tier, device evictions go
straight to disk. `KVTiers.flush()` writes the host tier's blocks to disk (call it at shutdown so a
restart finds them). Lookups go host, then disk; a disk hit is promoted to the host tier.

Blocks are keyed by their content hash (opaque bytes), so a hit is always the right data for the
right model: the disk tier is namespaced by the model fingerprint and checks it in every record.
NOTE: the tiers are not thread-safe: one thread (the offload I/O thread, `kvpager.kvstore.offload`)
reads and writes them; `contains` (a dict lookup) may be called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpager.core.hashing import BlockHash
from kvpager.kvstore.codec import Codec, Device, get_codec
from kvpager.kvstore.records import EncodedBlock, RecordError, decode_record, encode_record
from kvpager.model.dtypes import dtype_from_name, dtype_name

if TYPE_CHECKING:
    from kvpager.kvstore.remote import RemoteTier

logger = logging.getLogger("kvpager.kvstore.tiers")

RECORD_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 60.0
Spilled = list[tuple[BlockHash, EncodedBlock]]


@dataclass
class TierStats:
    """Counters of one tier; `bytes_*` count encoded bytes."""

    hits: int = 0
    misses: int = 0
    num_blocks: int = 0
    bytes_held: int = 0
    evictions: int = 0
    bytes_in: int = 0  # written into the tier
    bytes_out: int = 0  # read out of the tier on hits
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    skipped: int = 0  # disk: bad records detected, removed and never loaded
    write_errors: int = 0  # disk: writes that failed (logged; the engine carries on)


def encode_block(codec: Codec, block: torch.Tensor) -> EncodedBlock:
    """`block` through `codec`, with the shape and dtype needed to decode it."""
    return EncodedBlock(codec.name, tuple(block.shape), dtype_name(block.dtype), codec.encode(block))


def decode_block(encoded: EncodedBlock, device: Device = "cpu") -> torch.Tensor:
    """The tensor an `EncodedBlock` holds (ValueError if its codec, dtype or size is wrong)."""
    codec = get_codec(encoded.codec_name)
    return codec.decode(encoded.payload, encoded.shape, dtype_from_name(encoded.dtype), device)


class HostTier:
    """Bounded LRU map BlockHash -> encoded block in host RAM."""

    def __init__(self, capacity_bytes: int, codec: Codec) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host KV capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self._blocks: OrderedDict[BlockHash, EncodedBlock] = OrderedDict()  # NOTE: first = LRU
        self._stats = TierStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    @property
    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        return replace(self._stats, num_blocks=len(self._blocks))

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> Spilled:
        """Store `block` as most recently used; returns what was evicted to make room (to spill)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return []
        start = time.perf_counter()
        encoded = encode_block(self.codec, block)
        self._stats.save_seconds += time.perf_counter() - start
        return self.put_encoded(block_hash, encoded)

    def put_encoded(self, block_hash: BlockHash, encoded: EncodedBlock) -> Spilled:
        """Like `put` for an already encoded block. A block larger than the capacity is returned."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return []
        if encoded.nbytes > self.capacity_bytes:
            return [(block_hash, encoded)]
        spilled = self.evict(encoded.nbytes)
        self._blocks[block_hash] = encoded
        self._stats.bytes_held += encoded.nbytes
        self._stats.bytes_in += encoded.nbytes
        return spilled

    def get_encoded(self, block_hash: BlockHash) -> EncodedBlock | None:
        """The encoded block (now most recently used), or None; counts a hit or a miss."""
        encoded = self._blocks.get(block_hash)
        if encoded is None:
            self._stats.misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self._stats.hits += 1
        self._stats.bytes_out += encoded.nbytes
        return encoded

    def get(self, block_hash: BlockHash, device: Device = "cpu") -> torch.Tensor | None:
        """The decoded block on `device` (now most recently used), or None."""
        encoded = self.get_encoded(block_hash)
        if encoded is None:
            return None
        start = time.perf_counter()
        block = decode_block(encoded, device)
        self._stats.load_seconds += time.perf_counter() - start
        return block

    def evict(self, num_bytes: int) -> Spilled:
        """Evict least recently used blocks until `num_bytes` fit; returns them, oldest first."""
        evicted: Spilled = []
        while self._blocks and self._stats.bytes_held + num_bytes > self.capacity_bytes:
            block_hash, encoded = self._blocks.popitem(last=False)
            self._stats.bytes_held -= encoded.nbytes
            self._stats.evictions += 1
            evicted.append((block_hash, encoded))
        return evicted

    def items(self) -> list[tuple[BlockHash, EncodedBlock]]:
        """Every held block, least recently used first (does not touch LRU order or counters)."""
        return list(self._blocks.items())


class RecordTier:
    """What the tiers that keep checksummed records (disk, remote) share: decoding a verified record.

    A subclass provides `get_encoded` (the verified record's payload, counting the hit), `_reject`
    (drop a bad record, logged) and `_stats`.
    """

    _stats: TierStats

    def get_encoded(self, block_hash: BlockHash) -> EncodedBlock | None:
        raise NotImplementedError

    def _reject(self, block_hash: BlockHash, reason: str) -> None:
        raise NotImplementedError

    def load(self, block_hash: BlockHash, device: Device = "cpu") -> tuple[torch.Tensor, EncodedBlock] | None:
        """The decoded, verified block on `device` and its encoded form, or None. Never raises on a bad record."""
        encoded = self.get_encoded(block_hash)
        if encoded is None:
            return None
        start = time.perf_counter()
        try:
            block = decode_block(encoded, device)
        except ValueError as error:  # unknown codec/dtype, or a payload that does not fit its shape
            self._stats.hits -= 1
            self._reject(block_hash, f"undecodable payload: {error}")
            return None
        self._stats.load_seconds += time.perf_counter() - start
        return block, encoded

    def get(self, block_hash: BlockHash, device: Device = "cpu") -> torch.Tensor | None:
        """The decoded, verified block on `device`, or None. Never raises on a bad record."""
        loaded = self.load(block_hash, device)
        return None if loaded is None else loaded[0]


class DiskTier(RecordTier):
    """One checksummed file per block under `directory/<fingerprint hex[:16]>/<hash hex[:2]>/`.

    An in-memory index (hash -> file size, LRU order) is rebuilt at start by scanning the
    namespace directory (oldest mtime first); a hit refreshes the file's mtime. Files are verified
    when read: a bad one is removed, counted in `stats.skipped` and logged, and `get` returns None.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        fingerprint: bytes,
        codec: Codec,
        *,
        fsync: bool = False,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"disk KV max bytes must be >= 0, got {max_bytes}")
        _check_directory(Path(directory))
        self.root = Path(directory) / fingerprint.hex()[:16]
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.codec = codec
        self.fsync = fsync
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # NOTE: first = LRU; value = file size
        self._stats = TierStats()
        self._scan()
        self._evict_until(0)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    @property
    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        return replace(self._stats, num_blocks=len(self._index))

    def path_for(self, block_hash: BlockHash) -> Path:
        """Where the record of `block_hash` lives."""
        name = block_hash.hex()
        return self.root / name[:2] / (name + RECORD_SUFFIX)

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> bool:
        """Persist `block` with this tier's codec; False when it was not written (too big, I/O error)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return True
        start = time.perf_counter()
        encoded = encode_block(self.codec, block)
        self._stats.save_seconds += time.perf_counter() - start
        return self.put_encoded(block_hash, encoded)

    def put_encoded(self, block_hash: BlockHash, encoded: EncodedBlock) -> bool:
        """Persist an encoded block as is (a record carries its own codec name)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return True
        start = time.perf_counter()
        record = encode_record(self.fingerprint, block_hash, encoded)
        if len(record) > self.max_bytes:
            return False
        self._evict_until(len(record))
        try:
            self._write_atomic(self.path_for(block_hash), record)
        except OSError as error:
            self._stats.write_errors += 1
            logger.warning("KV disk tier: could not write block %s: %s", block_hash.hex()[:16], error)
            return False
        self._index[block_hash] = len(record)
        self._stats.bytes_held += len(record)
        self._stats.bytes_in += len(record)
        self._stats.save_seconds += time.perf_counter() - start
        return True

    def get_encoded(self, block_hash: BlockHash) -> EncodedBlock | None:
        """The verified encoded block, or None (miss, or a bad record that is now removed)."""
        if block_hash not in self._index:
            self._stats.misses += 1
            return None
        path = self.path_for(block_hash)
        start = time.perf_counter()
        try:
            data = path.read_bytes()
            encoded = decode_record(data, self.fingerprint, block_hash)
        except OSError as error:  # vanished or unreadable: forget it
            self._forget(block_hash)
            self._stats.misses += 1
            logger.warning("KV disk tier: could not read %s: %s", path, error)
            return None
        except RecordError as error:
            self._reject(block_hash, str(error))
            return None
        self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(path)  # NOTE: mtime is the LRU order the next start rebuilds
        self._stats.hits += 1
        self._stats.bytes_out += len(data)
        self._stats.load_seconds += time.perf_counter() - start
        return encoded

    def _reject(self, block_hash: BlockHash, reason: str) -> None:
        path = self.path_for(block_hash)
        logger.warning("KV disk tier: skipped and removed bad record %s: %s", path, reason)
        self._stats.skipped += 1
        self._stats.misses += 1
        self._remove(block_hash)

    def _remove(self, block_hash: BlockHash) -> None:
        with contextlib.suppress(OSError):
            self.path_for(block_hash).unlink()
        self._forget(block_hash)

    def _forget(self, block_hash: BlockHash) -> None:
        size = self._index.pop(block_hash, None)
        if size is not None:
            self._stats.bytes_held -= size

    def _evict_until(self, num_bytes: int) -> None:
        while self._index and self._stats.bytes_held + num_bytes > self.max_bytes:
            self._remove(next(iter(self._index)))
            self._stats.evictions += 1

    def _write_atomic(self, path: Path, data: bytes) -> None:
        # NOTE: readers only ever see complete records: the bytes go to a temporary file in the same
        # directory, then os.replace renames it into place atomically.
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                if self.fsync:
                    file.flush()
                    os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _scan(self) -> None:
        """Rebuild the index from the namespace directory; remove stale temporary files."""
        found: list[tuple[float, BlockHash, int]] = []
        for path in self.root.glob("??/*"):
            try:
                info = path.stat()
                if path.name.endswith(TMP_SUFFIX):
                    if time.time() - info.st_mtime > STALE_TMP_SECONDS:
                        path.unlink()
                    continue
                block_hash = _hash_from_name(path)
            except OSError:
                continue
            if block_hash is not None:
                found.append((info.st_mtime, block_hash, info.st_size))
        for _, block_hash, size in sorted(found, key=lambda item: item[0]):
            self._index[block_hash] = size
            self._stats.bytes_held += size


def _hash_from_name(path: Path) -> BlockHash | None:
    """The block hash a record file name encodes, or None for a name this tier never writes."""
    if path.suffix != RECORD_SUFFIX or not path.stem.startswith(path.parent.name):
        return None
    try:
        return BlockHash(bytes.fromhex(path.stem))
    except ValueError:
        return None


class KVTiers:
    """Host, disk and/or remote tiers behind two calls: `offload` (device eviction) and `lookup` (prefix miss).

    The remote tier (`remote.py`, shared by replicas) sits below disk: lookups reach it last, and a
    device eviction is also written through to it when the store does not hold the block yet.
    """

    def __init__(self, host: HostTier | None, disk: DiskTier | None, remote: RemoteTier | None = None) -> None:
        self.host = host
        self.disk = disk
        self.remote = remote

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a tier holds the block; for the remote tier, as far as earlier answers tell (no round trip)."""
        return self.contains_locally(block_hash) or (self.remote is not None and self.remote.contains(block_hash))

    def remote_lookup_chain(self, hashes: Sequence[BlockHash], staged: Collection[BlockHash]) -> list[BlockHash] | None:
        """The part of a chain only a round trip to the remote store can answer for: from the first
        block neither `staged` nor known to a tier, when the store has no fresh answer for it; None when
        `contains` answers for the whole chain now (no remote tier, store down, answers still known)."""
        if self.remote is None:
            return None
        for index, block_hash in enumerate(hashes):
            if block_hash in staged or self.contains(block_hash):
                continue
            return list(hashes[index:]) if self.remote.needs_lookup(block_hash) else None
        return None

    def contains_locally(self, block_hash: BlockHash) -> bool:
        """Whether the host or disk tier holds the block."""
        return (self.host is not None and block_hash in self.host) or (
            self.disk is not None and block_hash in self.disk
        )

    def offload(self, block_hash: BlockHash, block: torch.Tensor, *, write_remote: bool = True) -> None:
        """Keep a block the device pool is evicting: host first, spilling host evictions to disk.

        `write_remote=False`: the caller writes the remote tier itself (from a writer thread, under TP).
        """
        if self.remote is not None and write_remote:
            self.remote.put(block_hash, block)  # NOTE: a no-op for blocks the store is known to hold
        if self.host is None:
            if self.disk is not None:
                self.disk.put(block_hash, block)
            return
        self._spill(self.host.put(block_hash, block))

    def lookup(self, block_hash: BlockHash, device: Device = "cpu") -> torch.Tensor | None:
        """The block from the host tier, else disk, else remote (disk/remote hits are promoted to host)."""
        if self.host is not None:
            block = self.host.get(block_hash, device)
            if block is not None:
                return block
        loaded = None
        if self.disk is not None:
            loaded = self.disk.load(block_hash, device)
        if loaded is None and self.remote is not None:
            loaded = self.remote.load(block_hash, device)
        if loaded is None:
            return None
        block, encoded = loaded
        if self.host is not None:
            self._spill(self.host.put_encoded(block_hash, encoded))
        return block

    def flush(self) -> int:
        """Write every host block that is not on disk yet; returns how many were written."""
        if self.host is None or self.disk is None:
            return 0
        pending = [(h, e) for h, e in self.host.items() if h not in self.disk]
        return sum(self.disk.put_encoded(block_hash, encoded) for block_hash, encoded in pending)

    def _spill(self, spilled: Spilled) -> None:
        if self.disk is not None:
            for block_hash, encoded in spilled:
                self.disk.put_encoded(block_hash, encoded)


def _check_directory(directory: Path) -> None:
    """ValueError unless `directory` is a writable directory or can be created as one."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--kv-cache-dir {str(directory)!r} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--kv-cache-dir {str(directory)!r} cannot be created: {error.strerror or error}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"--kv-cache-dir {str(directory)!r} is not writable")

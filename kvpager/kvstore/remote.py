"""The remote KV tier: blocks in a Redis or Valkey server that every replica of a model shares.

`--kv-cache-remote redis://HOST:PORT[/DB]` adds this tier below host and disk. A block is stored as
the disk tier's checksummed record (`records.py`: fingerprint, hash, codec, shape, sha256) under the
key `kvpager:v1:<fingerprint hex[:16]>:<block hash hex>`, encoded with the same `--kv-codec`, so a
prefix computed on replica A is a verified hit on replica B, or on a replica started later.

Writes: every block the device pool caches is written once its forward has run (`publisher.py`,
from its own thread), and a device eviction writes any block the store does not have yet
(write-through: e.g. one computed while the store was down). Reads: a prefix miss in the pool, host
and disk first asks the store which blocks of the chain it holds (`lookup`: one pipelined EXISTS,
on the tier store's lookup thread), then fetches them (`prefetch`: MGET, on the I/O thread). A record
that fails its checks is deleted from the store and never loaded.

Size: the store is bounded by the server's own eviction, not by kvpager: run it with `maxmemory` and
`maxmemory-policy allkeys-lru` (checked at start; a warning when it is unbounded or does not evict).

Failure: every call has a socket timeout (`--kv-cache-remote-timeout`). A store that is down or slow
is a miss: the prefix is recomputed, the reason is logged once, and the tier stays off for
`retry_interval_s` before the next call tries again. A request never fails because of the store.
Tensor parallelism: each rank's tier stores its shard of a block (`shards.py`: the KV heads it
holds) under `kvpager:v1:<fingerprint hex[:16]>:<shard tag>:<block hash hex>` (no tag for a whole
block, so TP=1 keys are unchanged), as a record whose fingerprint is bound to the heads. Rank 0's
tier asks about every distinct shard (`lookup_shards`): a block counts as held only when all are.
Threads: no call made on the engine thread talks to the server (`contains`, `knows`, `needs_lookup`
read what earlier answers left); the lookup, I/O and publisher threads make the calls. The tier's own
state (what is known present or absent, the fetched records, the counters) is behind one lock,
never held across a network call.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvpager.core.hashing import BlockHash
from kvpager.kvstore.codec import Codec
from kvpager.kvstore.records import EncodedBlock, RecordError, decode_record, encode_record
from kvpager.kvstore.shards import KVShard
from kvpager.kvstore.tiers import RecordTier, TierStats, encode_block

logger = logging.getLogger("kvpager.kvstore.remote")

REMOTE_SCHEMES = ("redis", "rediss")
KEY_PREFIX = "kvpager:v1:"
DEFAULT_REMOTE_TIMEOUT_S = 1.0
DEFAULT_RETRY_INTERVAL_S = 5.0
KNOWN_CAPACITY = 1 << 16  # hashes remembered as present in the store (saves a round trip per check)
ABSENT_CAPACITY = 1 << 14  # hashes the store answered as absent
ABSENT_TTL_S = 2.0  # how long an "absent" answer stands (another replica may write the block later)
MGET_BATCH = 16  # records fetched per round trip by `prefetch`
_FAILED = object()  # what `_call` returns when the store did not answer


@dataclass
class RemoteTierStats(TierStats):
    """`TierStats` plus the store's availability: failed calls and calls skipped while it was down."""

    errors: int = 0  # calls that failed (connection refused, timeout, server error)
    unavailable: int = 0  # calls answered as a miss without trying, while the store was marked down
    published: int = 0  # blocks written right after their forward (`RemotePublisher`)
    lookups: int = 0  # batched lookups (one round trip each), off the engine thread
    publish_dropped: int = 0  # blocks the publisher dropped because its queue was full (oldest first)


def check_remote_url(url: str) -> str:
    """`url` if it names a Redis/Valkey server (redis://HOST:PORT[/DB], rediss:// for TLS); else ValueError."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in REMOTE_SCHEMES or not parsed.hostname:
        raise ValueError(f"--kv-cache-remote must look like redis://HOST:PORT (or rediss:// for TLS), got {url!r}")
    try:
        parsed.port  # noqa: B018  # NOTE: urlsplit only checks the port when it is read
    except ValueError as error:
        raise ValueError(f"--kv-cache-remote {url!r}: {error}") from None
    return url


def redact(url: str) -> str:
    """The URL without its password (for logs)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    netloc = f"{parsed.username or ''}:***@{parsed.hostname}" + (f":{parsed.port}" if parsed.port else "")
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


def connect(url: str, timeout_s: float) -> Any:
    """A redis-py client with `timeout_s` on connect and on every reply, and no retries of its own."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as error:
        raise ValueError("--kv-cache-remote needs the redis package: pip install 'kvpager[remote]'") from error
    return redis.Redis.from_url(
        check_remote_url(url),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # NOTE: the tier's own back-off replaces redis-py's retries
        health_check_interval=0,
    )


class RemoteTier(RecordTier):
    """Blocks of one model (fingerprint) in a shared Redis/Valkey server; see the module docstring."""

    _stats: RemoteTierStats

    def __init__(
        self,
        client: Any,
        fingerprint: bytes,
        codec: Codec,
        *,
        name: str = "remote",
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        shard: KVShard | None = None,
        lookup_shards: Sequence[KVShard] = (),
    ) -> None:
        """`shard`: the KV heads this tier's records hold (None: whole blocks); `lookup_shards`: the
        shards `lookup` requires for a block to count as held (default: this tier's own)."""
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        self.client = client
        self.fingerprint = fingerprint
        self.codec = codec
        self.name = name
        self.retry_interval_s = retry_interval_s
        self.prefix = f"{KEY_PREFIX}{fingerprint.hex()[:16]}:".encode()
        self.shard = shard
        self.record_fingerprint = shard.record_fingerprint(fingerprint) if shard is not None else fingerprint
        self.lookup_shards: tuple[KVShard | None, ...] = tuple(lookup_shards) or (shard,)
        self._stats = RemoteTierStats()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()
        self._absent: OrderedDict[BlockHash, float] = OrderedDict()  # hash -> when it was answered absent
        self._stash: dict[BlockHash, bytes | None] = {}  # prefetched records (None: absent), for `get_encoded`
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._down_reason: str | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        fingerprint: bytes,
        codec: Codec,
        timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        shard: KVShard | None = None,
        lookup_shards: Sequence[KVShard] = (),
    ) -> RemoteTier:
        """Connect lazily (the first call connects); the eviction policy is checked now when reachable."""
        tier = cls(
            connect(url, timeout_s),
            fingerprint,
            codec,
            name=redact(url),
            retry_interval_s=retry_interval_s,
            shard=shard,
            lookup_shards=lookup_shards,
        )
        tier.check_eviction_policy()
        return tier

    # -- state ----------------------------------------------------------------------------------
    @property
    def stats(self) -> RemoteTierStats:
        """A snapshot of the counters (`num_blocks`/`bytes_held` count this engine's writes)."""
        with self._lock:
            return replace(self._stats)

    def count(self, name: str, value: int = 1) -> None:
        """Add `value` to counter `name` (for the publisher, from its thread)."""
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + value)

    @property
    def available(self) -> bool:
        """False while the store is marked down after a failed call (until the retry interval passes)."""
        return self._down_since is None or time.monotonic() >= self._down_since + self.retry_interval_s

    def knows(self, block_hash: BlockHash) -> bool:
        """Whether this engine wrote or read `block_hash` recently (no round trip; may be stale)."""
        return block_hash in self._known

    def recent_known(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes this engine wrote to or found in the store, newest first (what a replica
        reports to the router; may be stale: the server's LRU can have evicted them since)."""
        with self._lock:
            return list(itertools.islice(reversed(self._known), max(limit, 0)))

    def key(self, block_hash: BlockHash) -> bytes:
        """The key of this tier's record (its shard) of `block_hash`."""
        return self.shard_key(block_hash, self.shard)

    def shard_key(self, block_hash: BlockHash, shard: KVShard | None) -> bytes:
        """The key of `shard`'s record of `block_hash` (None or a whole shard: the TP=1 key)."""
        tag = shard.tag if shard is not None else ""
        return self.prefix + (f"{tag}:" if tag else "").encode() + block_hash.hex().encode()

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Stop taking `hashes` as held (a tensor-parallel load found a rank's shard missing): the next
        request for them asks the store again."""
        with self._lock:
            for block_hash in hashes:
                self._known.pop(block_hash, None)

    # -- the tier protocol ----------------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the store is known to hold the block (an earlier answer or write; no round trip, may be stale)."""
        return block_hash in self._known

    def needs_lookup(self, block_hash: BlockHash) -> bool:
        """Whether only a round trip can tell if the store holds the block (unknown, store not marked down)."""
        if block_hash in self._known or not self.available:
            return False
        with self._lock:
            answered = self._absent.get(block_hash)
            if answered is not None and time.monotonic() < answered + ABSENT_TTL_S:
                return False
        return True

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Ask the store which of `hashes` it holds (one pipelined EXISTS); returns the leading run held.

        Every answer is remembered (`contains` / `needs_lookup` read it). A store that is down is a miss.
        A block is held when the record of every one of `lookup_shards` is (one EXISTS of all their keys).
        """
        unknown = [h for h in hashes if h not in self._known]
        if unknown:
            self.count("lookups")
            shards = self.lookup_shards

            def exists() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for block_hash in unknown:
                    pipe.exists(*(self.shard_key(block_hash, shard) for shard in shards))
                return list(pipe.execute())

            counts = self._call("lookup", exists, None)
            if not isinstance(counts, list):
                return 0
            answers = [int(found) == len(shards) for found in counts]
            now = time.monotonic()
            with self._lock:
                for block_hash, held in zip(unknown, answers, strict=True):
                    if held:
                        self._remember_locked(block_hash)
                        self._absent.pop(block_hash, None)
                    else:
                        self._absent[block_hash] = now
                        self._absent.move_to_end(block_hash)
                while len(self._absent) > ABSENT_CAPACITY:
                    self._absent.popitem(last=False)
        count = 0
        for block_hash in hashes:
            if block_hash not in self._known:
                break
            count += 1
        return count

    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """Fetch the records of a chain's blocks (MGET, `MGET_BATCH` per round trip) for `get_encoded`.

        Stops at the first block the store does not return; `get_encoded` then answers from what was
        fetched without a round trip of its own. Call `get_encoded` for each hash afterwards.
        """
        for start in range(0, len(hashes), MGET_BATCH):
            batch = list(hashes[start : start + MGET_BATCH])
            records = self._call("read", lambda b=batch: self.client.mget([self.key(h) for h in b]), None)
            if not isinstance(records, list):
                return
            with self._lock:
                for block_hash, record in zip(batch, records, strict=True):
                    self._stash[block_hash] = record if isinstance(record, bytes) else None
            if not all(isinstance(record, bytes) for record in records):
                return

    def drop_prefetched(self, hashes: Sequence[BlockHash]) -> None:
        """Forget the prefetched records of `hashes` that `get_encoded` did not take (after a load)."""
        with self._lock:
            for block_hash in hashes:
                self._stash.pop(block_hash, None)

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> bool:
        """Write `block` with this tier's codec unless the store is known to hold it; False when not written."""
        if block_hash in self._known:
            return True
        if not self.available:
            self.count("unavailable")
            return False
        start = time.perf_counter()
        encoded = encode_block(self.codec, block)
        with self._lock:
            self._stats.save_seconds += time.perf_counter() - start
        return self.put_encoded(block_hash, encoded)

    def put_encoded(self, block_hash: BlockHash, encoded: EncodedBlock) -> bool:
        """Write an encoded block as its checksummed record (SET NX: a held copy is never rewritten)."""
        if block_hash in self._known:
            return True
        start = time.perf_counter()
        record = encode_record(self.record_fingerprint, block_hash, encoded)
        written = self._call("write", lambda: self.client.set(self.key(block_hash), record, nx=True), _FAILED)
        if written is _FAILED:
            return False
        with self._lock:
            self._remember_locked(block_hash)
            if written:
                self._stats.num_blocks += 1
                self._stats.bytes_held += len(record)
                self._stats.bytes_in += len(record)
            self._stats.save_seconds += time.perf_counter() - start
        return True

    def get_encoded(self, block_hash: BlockHash) -> EncodedBlock | None:
        """The verified encoded block, or None (a miss, a store that is down, or a bad record, now deleted)."""
        start = time.perf_counter()
        with self._lock:
            prefetched = block_hash in self._stash
            record = self._stash.pop(block_hash, None)
        if not prefetched:
            fetched = self._call("read", lambda: self.client.get(self.key(block_hash)), None)
            record = fetched if isinstance(fetched, bytes) else None
        if record is None:
            with self._lock:
                self._known.pop(block_hash, None)  # NOTE: the server evicted it (LRU) or never had it
                self._stats.misses += 1
            return None
        try:
            encoded = decode_record(record, self.record_fingerprint, block_hash)
        except RecordError as error:
            self._reject(block_hash, str(error))
            return None
        with self._lock:
            self._remember_locked(block_hash)
            self._stats.hits += 1
            self._stats.bytes_out += len(record)
            self._stats.load_seconds += time.perf_counter() - start
        return encoded

    # -- the server -----------------------------------------------------------------------------
    def check_eviction_policy(self) -> str | None:
        """A warning when the server is unbounded or does not evict (None when fine or not checkable)."""
        config = self._call("CONFIG GET", lambda: self.client.config_get("maxmemory*"), None)
        if not isinstance(config, dict):
            return None
        maxmemory = int(config.get("maxmemory", 0) or 0)
        policy = str(config.get("maxmemory-policy", ""))
        warning = None
        if maxmemory == 0:
            warning = "has no maxmemory: it will grow without bound"
        elif not policy.startswith("allkeys-"):
            warning = f"evicts with maxmemory-policy {policy}: writes fail once it is full"
        if warning is not None:
            logger.warning("KV store %s %s; run it with maxmemory and maxmemory-policy allkeys-lru", self.name, warning)
        else:
            logger.info("KV store %s: maxmemory %d bytes, policy %s", self.name, maxmemory, policy)
        return warning

    def _call(self, what: str, fn: Any, default: Any) -> Any:
        """`fn()`, or `default` when the store is down, slow or refuses (the reason is logged)."""
        import redis

        if not self.available:
            self.count("unavailable")
            return default
        try:
            result = fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            self._mark_down(what, error)
            return default
        except redis.RedisError as error:  # the server answered with an error (e.g. OOM under noeviction)
            self.count("errors")
            if what == "write":
                self.count("write_errors")
            logger.warning("KV store %s refused a %s: %s", self.name, what, error)
            return default
        with self._lock:
            was_down, self._down_reason, self._down_since = self._down_reason is not None, None, None
        if was_down:
            logger.info("KV store %s is reachable again", self.name)
        return result

    def _mark_down(self, what: str, error: BaseException) -> None:
        reason = f"{type(error).__name__}: {error}"
        with self._lock:
            self._stats.errors += 1
            self._down_since = time.monotonic()
            first, self._down_reason = self._down_reason is None, reason
        if first:
            logger.warning(
                "KV store %s failed a %s (%s); prefixes are recomputed, next try in %g s",
                self.name,
                what,
                reason,
                self.retry_interval_s,
            )

    def _reject(self, block_hash: BlockHash, reason: str) -> None:
        logger.warning("KV store %s: deleted bad record of block %s: %s", self.name, block_hash.hex()[:16], reason)
        with self._lock:
            self._stats.skipped += 1
            self._stats.misses += 1
            self._known.pop(block_hash, None)
        self._call("delete", lambda: self.client.delete(self.key(block_hash)), None)

    def _remember_locked(self, block_hash: BlockHash) -> None:
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        while len(self._known) > KNOWN_CAPACITY:
            self._known.popitem(last=False)

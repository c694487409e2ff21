"""HMAC-SHA256 signatures of KV payloads, so an engine imports KV only from a peer holding its key.

A block's identity in the prefix cache is its token ids and the model fingerprint, never its K/V
contents, so whoever may import KV decides what every later request with those tokens computes.
A prefill server started with `--kv-transfer-key` signs each payload it exports; a server
accepting imports (`--enable-kv-import`, or `--role decode` fetching from its prefill server)
refuses any payload whose signature under the same key does not verify. The signature covers the
exact payload bytes (header, token ids, every block), so no part can be swapped. Threat model:
docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-KVPager-KV-Signature"
_SCHEME = "hmac-sha256="


def sign_payload(key: str, payload: bytes) -> str:
    """The signature header value of `payload` under `key`: "hmac-sha256=<64 hex digits>"."""
    return _SCHEME + hmac.new(key.encode("utf-8"), payload, hashlib.sha256).hexdigest()


def verify_payload(key: str, payload: bytes, signature: str | None) -> None:
    """ValueError unless `signature` is `payload`'s signature under `key` (constant-time compare)."""
    if not signature:
        raise ValueError(
            f"the KV payload is unsigned; imports need the {SIGNATURE_HEADER} header made with the shared "
            "--kv-transfer-key (see docs/security.md)"
        )
    if not hmac.compare_digest(signature.strip().encode("utf-8", "replace"), sign_payload(key, payload).encode()):
        raise ValueError("the KV payload's signature does not verify under this server's --kv-transfer-key; refused")

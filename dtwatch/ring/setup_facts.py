"""The ring's setup-facts block: what a rank knows about its own setup, for the setup checks.

A small JSON document in the free tail of the ring's header (``FACTS_OFFSET`` .. ``HEADER_SIZE``),
written by the rank at setup time (the default group appears, a model is wrapped by DDP/FSDP, a
DataLoader starts an epoch, a batch fingerprint is ready), never per collective. Layout::

    u32 length | u32 crc32 of the document | length bytes of UTF-8 JSON

A reader that catches the block mid-write sees a checksum that does not match and reads no facts (the
next read sees them). The document's fields are described in :mod:`dtwatch.record.setup_facts`.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import Any

FACTS_OFFSET = 1024  # after the header's live fields (they end before 1024)
FACTS_END = 4096  # the header's size
FACTS_HEAD = struct.Struct("<II")  # length, crc32
FACTS_CAPACITY = FACTS_END - FACTS_OFFSET - FACTS_HEAD.size


def encode_facts(doc: dict[str, Any]) -> bytes:
    """The document as written (compact JSON); may be longer than ``FACTS_CAPACITY`` (the writer trims)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, default=str).encode("utf-8")


def write_facts(buf: Any, payload: bytes) -> bool:
    """Write an encoded document into a ring's header (an mmap); False when it does not fit."""
    if len(payload) > FACTS_CAPACITY:
        return False
    start = FACTS_OFFSET + FACTS_HEAD.size
    FACTS_HEAD.pack_into(buf, FACTS_OFFSET, 0, 0)  # readers see "no facts" while the bytes change
    buf[start : start + len(payload)] = payload
    FACTS_HEAD.pack_into(buf, FACTS_OFFSET, len(payload), zlib.crc32(payload))
    return True


def read_facts(data: bytes | memoryview) -> dict[str, Any]:
    """The facts document of a ring's bytes; ``{}`` when there is none (or it is being rewritten)."""
    if len(data) < FACTS_END:
        return {}
    length, crc = FACTS_HEAD.unpack_from(data, FACTS_OFFSET)
    if not length or length > FACTS_CAPACITY:
        return {}
    start = FACTS_OFFSET + FACTS_HEAD.size
    payload = bytes(data[start : start + length])
    if zlib.crc32(payload) != crc:
        return {}
    try:
        doc = json.loads(payload)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}

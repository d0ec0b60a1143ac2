"""The ring's setup-facts block: what a rank knows about its own setup, for the setup checks.

A small JSON document in the free tail of the ring's header (``FACTS_OFFSET`` .. ``FACTS_END``, see
:mod:`dtwatch.ring.layout`), written by the rank at setup time (the default group appears, a model is
wrapped by DDP/FSDP, a DataLoader starts an epoch, a batch fingerprint is ready), never per collective.
Layout: the ``FACTS_HEAD`` fields (u32 length, u32 crc32 of the document), then ``length`` bytes of
UTF-8 JSON.

A reader that catches the block mid-write sees a length of 0 or a checksum that does not match and reads
no facts (the next read sees them). The document's fields are described in
:mod:`dtwatch.record.setup_probe`.
"""
from __future__ import annotations

import json
import zlib
from typing import Any

from dtwatch.ring.layout import FACTS_CAPACITY, FACTS_END, FACTS_HEAD, FACTS_OFFSET

_DOC_OFFSET = FACTS_OFFSET + FACTS_HEAD.size


def encode_facts(doc: dict[str, Any]) -> bytes:
    """The document as written (compact JSON); may be longer than ``FACTS_CAPACITY`` (the writer trims)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, default=str).encode("utf-8")


def write_facts(buf: Any, payload: bytes) -> bool:
    """Write an encoded document into a ring's header (an mmap); False when it does not fit."""
    if len(payload) > FACTS_CAPACITY:
        return False
    FACTS_HEAD.pack_into(buf, FACTS_OFFSET, length=0, crc32=0)  # readers see "no facts" while the bytes change
    buf[_DOC_OFFSET : _DOC_OFFSET + len(payload)] = payload
    FACTS_HEAD.pack_into(buf, FACTS_OFFSET, length=len(payload), crc32=zlib.crc32(payload))
    return True


def read_facts(data: bytes | memoryview) -> dict[str, Any]:
    """The facts document of a ring's bytes; ``{}`` when there is none (or it is being rewritten)."""
    if len(data) < FACTS_END:
        return {}
    head = FACTS_HEAD.unpack(data, FACTS_OFFSET)
    length = head["length"]
    if not length or length > FACTS_CAPACITY:
        return {}
    payload = bytes(data[_DOC_OFFSET : _DOC_OFFSET + length])
    if zlib.crc32(payload) != head["crc32"]:
        return {}
    try:
        doc = json.loads(payload)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}

"""ZMQ frame layout shared by the publisher and the subscriber.

Live:    ``[topic, seq (8-byte big-endian), payload]`` on PUB/SUB.
Replay:  DEALER sends ``[b"", start_seq]``; ROUTER answers ``[b"", topic, seq, payload]`` per
         buffered batch with seq >= start_seq, then the end marker ``[b"", b"", END_SEQ, b""]``.
         SGLang 0.5.17 answers without the topic frame: ``[b"", seq, payload]``.
Dump:    kvtier extension, only for publishers that declare it: DEALER sends
         ``[b"", DUMP_REQUEST]``; ROUTER answers the publisher's whole current state as
         batches whose seq is the last live seq the state includes, then the end marker.
"""

from __future__ import annotations

import struct

#: The seq frame of the replay end marker: eight 0xFF bytes (-1 as signed int64).
END_SEQ = b"\xff" * 8
#: Request for a full state dump (4 bytes, so it can never be mistaken for a seq frame).
DUMP_REQUEST = b"DUMP"

_SEQ = struct.Struct(">q")


#: The last seq a batch may carry: a subscriber asks for the seq after the last it holds (a probe, a replay from the
#: first missing), and that one must still fit the frame. Publishers number from 0, so no real stream gets near it.
MAX_SEQ = 2**63 - 2


def pack_seq(seq: int) -> bytes:
    """8-byte big-endian signed sequence number."""
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    """Inverse of :func:`pack_seq`; raises ``ValueError`` unless ``frame`` is 8 bytes holding a seq in
    ``[0, MAX_SEQ]`` (the end marker, -1, is told apart by its bytes before this)."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    seq = int(_SEQ.unpack(frame)[0])
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq {seq} outside [0, {MAX_SEQ}]")
    return seq

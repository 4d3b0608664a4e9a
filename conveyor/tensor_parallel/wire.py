"""Length-prefixed frames over a worker's stdin pipe (8-byte little-endian length, then the bytes).

The payloads are JSON (the start-up header) or plan_wire bytes (one per step); a zero length says stop.
No pickle crosses the pipe. A parent that dies closes the pipe, and the worker reads end-of-file and exits.
"""

from __future__ import annotations

import struct
from typing import IO

_LENGTH = struct.Struct("<Q")
STOP = b""


def write_frame(pipe: IO[bytes], payload: bytes) -> None:
    pipe.write(_LENGTH.pack(len(payload)) + payload)
    pipe.flush()


def read_frame(pipe: IO[bytes]) -> bytes | None:
    """The next payload; None at end of file (the parent is gone); b"" for STOP."""
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    payload = pipe.read(length)
    if len(payload) < length:
        return None
    return payload

"""msgpack with strict types: the only wire format (no pickle anywhere)."""

from __future__ import annotations

import array
import base64
import sys
from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class CodecError(ValueError):
    """Bytes that are not a valid mlxq message."""


def text(x: Any) -> str:
    """A Redis reply (bytes, as a client without decode_responses gives it) or any value, as str."""
    return x.decode() if isinstance(x, bytes) else str(x)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=False)


def unpack(data: bytes | bytearray | memoryview | None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Decode one msgpack value, refusing oversized, truncated or non-msgpack input."""
    if data is None:
        raise CodecError("no data")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise CodecError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CodecError(f"msgpack extension type {code} is not allowed")


# A finished job's record keeps its token ids as a string of one character per id, code point =
# id (ids from 0xD800 up shifted past the 2048 surrogates, which UTF-8 cannot carry): 1 to 3 bytes
# an id where msgpack's ints take 3 for every id from 128 up, and still a msgpack string that every
# reader decodes, Redis's own Lua (no bin type there) included.
SURROGATES, SHIFT = 0xD800, 0x800
MAX_PACKED_ID = 0x10FFFF - SHIFT


def pack_ids(ids: list[int]) -> str | list:
    """Token ids as a finished record keeps them (PROTOCOL.md, section 6); a list it cannot hold
    (an id out of range) stays a list."""
    if not all(0 <= i <= MAX_PACKED_ID for i in ids):
        return list(ids)
    return "".join(chr(i if i < SURROGATES else i + SHIFT) for i in ids)


def unpack_ids(value: Any) -> Any:
    """``pack_ids`` undone; anything but a string is given back as it is (a list of ids, or what
    the caller's own validation refuses)."""
    if not isinstance(value, str):
        return value
    return [c if c < SURROGATES else c - SHIFT for c in map(ord, value)]


# An embedding job's vector (PROTOCOL.md, "Embedding jobs"): its float32 values, little-endian,
# base64: 4 bytes a dimension and a third more, a msgpack and JSON string every reader takes.
def pack_vector(raw: bytes) -> str:
    """Little-endian float32 bytes as a result keeps them."""
    return base64.b64encode(raw).decode("ascii")


def unpack_vector(value: str) -> list[float]:
    """``pack_vector`` undone, as floats (CodecError: not a packed vector)."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"not a packed vector: {exc}") from None
    if len(raw) % 4:
        raise CodecError(f"not a packed vector: {len(raw)} bytes is not a whole number of float32 values")
    out = array.array("f", raw)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()

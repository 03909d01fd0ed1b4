"""msgpack with strict types: the only wire format (no pickle anywhere)."""

from __future__ import annotations

from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class CodecError(ValueError):
    """Bytes that are not a valid mlxq message."""


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

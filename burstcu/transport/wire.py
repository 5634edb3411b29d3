"""The encoding of what ranks tell each other outside the payload: agreement rounds, barriers,
the bootstrap's checks. A fixed, versioned encoding of plain values — never pickle, so a peer's
bytes can only ever decode to data, not run code.

Format (version 1): the ASCII header ``burstcu-wire/1\\n``, then one JSON document (UTF-8)
whose values are

    null, true/false, integers, strings, lists      as themselves
    floats                                          JSON numbers; {"f": "inf" | "-inf" | "nan"}
    a tuple                                         {"t": [...]}
    bytes                                           {"b": "<hex>"}
    a dict (keys any plain value)                   {"d": [[key, value], ...]}

and nothing else: anything outside this list is refused on encoding (TypeError: send plain
values; an exception travels as its type's name and message, `burstcu.validate.InputError`),
and a document with any other object, a header of another version, or more than MAX_BYTES is
refused on decoding (ValueError). NumPy scalars encode as the Python values they hold.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

HEADER = b"burstcu-wire/1\n"
MAX_BYTES = 1 << 20   # an agreement carries shapes, options and messages: kilobytes at most
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _plain(x: Any) -> Any:
    """x as JSON-ready values (see the module docstring)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":   # by kind: longdouble.item() is
        return _plain({"b": bool, "i": int, "u": int, "f": float}[x.dtype.kind](x))   # a longdouble
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"f": repr(float(x))}
    if isinstance(x, tuple):
        return {"t": [_plain(v) for v in x]}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, (bytes, bytearray)):
        return {"b": bytes(x).hex()}
    if isinstance(x, dict):
        return {"d": [[_plain(k), _plain(v)] for k, v in x.items()]}
    raise TypeError(f"burstcu's wire encoding carries plain values only (None, bool, int, float, "
                    f"str, bytes, tuple, list, dict), not {type(x).__module__}.{type(x).__name__}")


def _tagged(obj: dict) -> Any:
    """One decoded JSON object back to its value; any other object is refused."""
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == "t" and isinstance(value, list):
            return tuple(value)
        if tag == "f" and isinstance(value, str) and value in _NON_FINITE:
            return _NON_FINITE[value]
        if tag == "b" and isinstance(value, str):
            return bytes.fromhex(value)
        if tag == "d" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
            return dict(value)   # an unhashable key: TypeError, refused in `decode`
    raise ValueError(f"burstcu wire: not a value of this encoding: {str(obj)[:200]}")


def encode(obj: Any, limit: int = MAX_BYTES) -> bytes:
    """obj as wire bytes. TypeError for anything but plain values, ValueError past `limit` bytes
    (MAX_BYTES; an answer that carries every rank's message may take their number of times)."""
    data = HEADER + json.dumps(_plain(obj), separators=(",", ":"), allow_nan=False).encode()
    if len(data) > limit:
        raise ValueError(f"burstcu wire: a message of {len(data)} bytes is over the bound of "
                         f"{limit} bytes")
    return data


def decode(data: bytes | bytearray | memoryview, limit: int = MAX_BYTES) -> Any:
    """The value `encode` made of it; ValueError for anything else (another version, more than
    `limit` bytes, not this encoding)."""
    data = bytes(data)
    if len(data) > limit:
        raise ValueError(f"burstcu wire: a message of {len(data)} bytes is over the bound of "
                         f"{limit} bytes")
    if not data.startswith(HEADER):
        raise ValueError(f"burstcu wire: not a message of this version (starts {data[:20]!r}, "
                         f"expected {HEADER!r}): are all ranks running the same burstcu?")
    try:
        return json.loads(data[len(HEADER):], object_hook=_tagged, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, TypeError) as exc:
        raise ValueError(f"burstcu wire: a malformed message ({type(exc).__name__}: {exc})") from None


def _refuse_constant(name: str):
    raise ValueError(f"burstcu wire: bare {name} is not part of the encoding")


# ------------------------------------------------------------------------------------------------
# labelled messages: what ranks send in an agreement round

def labelled(what: str, obj: Any) -> bytes:
    """The message (what, obj) of an agreement round named `what`. What cannot be encoded here
    travels as (what, None, why), so that every rank hears of it instead of this rank raising
    alone while the others wait for its message."""
    try:
        return encode((what, obj))
    except (TypeError, ValueError, RecursionError) as exc:
        return encode((what, None, f"it cannot be encoded ({type(exc).__name__}: {str(exc)[:500]})"))


def unlabelled(data: bytes) -> tuple[str, Any, str | None]:
    """(what, obj, problem) of a `labelled` message: problem says why it cannot be used (it did
    not decode, is not a labelled message, or its sender could not encode it), else None."""
    try:
        message = decode(data)
    except ValueError as exc:
        return "?", None, f"it cannot be read ({exc})"
    if isinstance(message, tuple) and len(message) in (2, 3) and isinstance(message[0], str):
        if len(message) == 2:
            return message[0], message[1], None
        if isinstance(message[2], str):
            return message[0], None, message[2]
    return "?", None, "it is not a labelled agreement message"

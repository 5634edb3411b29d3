"""burstcu.transport.wire: the encoding of agreement messages — plain values round-trip
exactly (tuples stay tuples, non-finite floats stay themselves), anything else is refused on
encoding, and bytes that are not this encoding (a pickle above all) are refused on decoding."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from burstcu.transport import wire
from burstcu.validate import InputError


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2**70, 1.5, "text ü", b"\x00\xff", [], (), {},
    (("attention", ((1, "S", 8, 64),), ("float32",), (("causal", True), ("softmax_scale", 0.125)))),
    [("a", 1), ["b", (2, 3.0)]], {"values": [None, (1, 2)], 3: "int key", (1, 2): "tuple key"},
    tuple(range(128)),   # an NCCL unique id
])
def test_plain_values_round_trip_exactly(value):
    back = wire.decode(wire.encode(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)   # nested tuples and lists keep their kinds


def test_non_finite_floats_and_numpy_scalars():
    inf, ninf, nan = wire.decode(wire.encode((math.inf, -math.inf, math.nan)))
    assert inf == math.inf and ninf == -math.inf and math.isnan(nan)
    assert wire.decode(wire.encode((np.float32(0.5), np.int64(3), np.bool_(True)))) == (0.5, 3, True)
    assert wire.decode(wire.encode(np.longdouble(1.5))) == 1.5


@pytest.mark.parametrize("value", [ValueError, ValueError("x"), np.zeros(3), object(), {1, 2},
                                   InputError(ValueError, "x"), complex(1, 2)])
def test_anything_else_is_refused_on_encoding(value):
    with pytest.raises(TypeError, match="plain values only"):
        wire.encode(("ok", value))


def test_an_input_error_crosses_as_its_kind_and_message():
    for kind in (ValueError, TypeError, MemoryError):
        err = InputError.from_plain(wire.decode(wire.encode(InputError(kind, "m").plain())))
        assert err.kind is kind and err.message == "m"
    assert InputError(np.exceptions.AxisError, "m").kind is ValueError   # a subclass: its base
    assert InputError(KeyError, "m").kind is TypeError
    assert InputError.from_plain(("SystemExit", "m")).kind is ValueError  # never another class


class _RunsCode:
    def __reduce__(self):
        return (print, ("unpickled",))


@pytest.mark.parametrize("data", [
    pickle.dumps(_RunsCode()),
    pickle.dumps(("attention", None)),
    b"burstcu-wire/2\n[]",
    wire.HEADER + b'{"x": 1}',            # an object of no tag
    wire.HEADER + b'{"t": [1], "f": 2}',  # two tags
    wire.HEADER + b'{"f": "1e999"}',
    wire.HEADER + b'{"d": [[[1], 2]]}',    # a list as a key
    wire.HEADER + b'{"d": [[{"d": []}, 1]]}',   # a dict as a key
    wire.HEADER + b'{"d": [[{"t": [[1]]}, 1]]}',   # a tuple holding a list as a key
    wire.HEADER + b'{"f": []}',
    wire.HEADER + b"NaN",
    wire.HEADER + b"[1,",
    wire.HEADER + b"\xff\xfe",
    wire.HEADER + b"[" * 100000,
    wire.HEADER + b" " * wire.MAX_BYTES,
])
def test_other_bytes_are_refused_on_decoding(data, capsys):
    with pytest.raises(ValueError, match="burstcu wire"):
        wire.decode(data)
    assert "unpickled" not in capsys.readouterr().out


def test_messages_are_bounded():
    with pytest.raises(ValueError, match="bound"):
        wire.encode("x" * wire.MAX_BYTES)


def test_labelled_messages_carry_what_could_not_be_sent():
    """What a rank cannot encode travels as a problem every rank reads (never an exception on
    that rank alone), and so does a message that is not a labelled one."""
    assert wire.unlabelled(wire.labelled("attention", (1, "S"))) == ("attention", (1, "S"), None)
    label, value, problem = wire.unlabelled(wire.labelled("attention", object()))
    assert label == "attention" and value is None and "cannot be encoded (TypeError" in problem
    assert wire.unlabelled(wire.encode([1, 2]))[2] == "it is not a labelled agreement message"
    assert wire.unlabelled(pickle.dumps(("attention", 1)))[2].startswith("it cannot be read")


def test_an_answer_may_carry_every_ranks_message():
    """Each rank's message is bounded by MAX_BYTES; rank 0's answer carries all of them."""
    big = "x" * (wire.MAX_BYTES // 2)
    answer = {"values": [big] * 4}
    with pytest.raises(ValueError, match="bound"):
        wire.encode(answer)
    assert wire.decode(wire.encode(answer, limit=4 * wire.MAX_BYTES), limit=4 * wire.MAX_BYTES) == answer

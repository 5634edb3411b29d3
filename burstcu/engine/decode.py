"""Decode against a sequence-sharded KV cache: one partial attention per rank, ONE all-gather of
the partials, the same merge on every rank ("flash decoding" with the keys split across ranks).

Shapes (B batch, T new tokens, H query heads, Hkv kv heads, D head dim, S_cache rows a rank
holds, G ranks):
    q (B, T, H, D): the same on every rank;  k_cache, v_cache (B, S_cache, Hkv, D): this rank's
    shard, rows in any order, or a paged cache (`burstcu.ops.decode.PagedRows`);  lengths (B,)
    host ints: valid rows of each batch row on this rank
    partial (`LocalOps.decode_partial`): acc (B, T, H, D), row max m and row sum l (B, H, T), in
        the accumulation dtype
    out (B, T, H, D) in q's dtype, lse (B, H, T) in the accumulation dtype: identical on every
        rank, since every rank merges the same partials in rank order (`LocalOps.decode_merge`;
        one rank: `LocalOps.decode_whole`, the merge of its partial alone)

Bytes one rank sends (`decode_bytes`), independent of the cache length:
    (G - 1) * B*T*H*(D + 2) * accumulation itemsize
(the transport's all-gather sends this rank's packed (acc, m, l) to each other rank; the op writes
the partial there, `packed_partials`). At one rank there is nothing to gather: the op ends its
partial itself (`LocalOps.decode_whole`).
"""

from __future__ import annotations

from ..ops.base import LocalOps, Message, accum_dtype
from ..transport.base import Transport


def decode(q, k_cache, v_cache, lengths, softmax_scale: float, ops: LocalOps,
           transport: Transport) -> tuple:
    """(out (B,T,H,D) in q's dtype, lse (B,H,T)): attention of q over every rank's first
    lengths[b] cache rows (module docstring). Collective over `transport`."""
    transport.where = "decode partial attention"
    if transport.size == 1:     # nothing to gather: the op may end the decode in fewer launches
        return ops.decode_whole(q, k_cache, v_cache, lengths, softmax_scale, q.dtype)
    packed = packed_partials(q, ops, transport.size)
    ops.decode_partial(q, k_cache, v_cache, lengths, softmax_scale,
                       out=(packed["acc"], packed["m"], packed["l"]))
    return ops.decode_merge(gathered_partials(packed, ops, transport), q.dtype)


def _fields(acc_shape, stat_shape, dtype, size: int, nbytes: int) -> list:
    """This rank's packed partial (acc, m, l; `nbytes` bytes) and room for all `size` of them."""
    return [("acc", acc_shape, dtype), ("m", stat_shape, dtype), ("l", stat_shape, dtype),
            ("gathered", (size, nbytes), "uint8")]


def packed_partials(q, ops: LocalOps, size: int) -> Message:
    """The op's kept message of decode's all-gather for q (B,T,H,D) over `size` ranks: this
    rank's partial, acc (B,T,H,D), m and l (B,H,T) in the accumulation dtype, one span that
    `LocalOps.decode_partial(..., out=...)` writes in place, and "gathered" (size, its bytes):
    no allocation after the first call of a shape, no copy of the partial."""
    b, t, h, d = q.shape
    dtype = accum_dtype(q.dtype)
    # One buffer is enough (the merge reads the gathered views before the call returns), but
    # the op keeps buffers only as double_buffer's pairs (`message` allocates at every call):
    # the other one of the pair stays idle: (G + 1) * B*T*H*(D+2) * 4 bytes, the partials' size
    # and not the cache's (9 MiB at B = 64, T = 1, H = 32, D = 128, G = 8), rather than an
    # allocation and a free at every token.
    nbytes = b * t * h * (d + 2) * dtype.itemsize
    return ops.double_buffer(_fields((b, t, h, d), (b, h, t), dtype, size, nbytes))[0]


def gathered_partials(packed: Message, ops: LocalOps, transport: Transport) -> list[tuple]:
    """Every rank's (acc, m, l), in rank order, after one all-gather of the partial in `packed`
    (`packed_partials`)."""
    acc, m = packed["acc"], packed["m"]
    gathered = packed["gathered"]
    transport.where = "decode all-gather of the partials"
    transport.allgather(packed.span("acc", "l"), gathered)
    fields = _fields(acc.shape, m.shape, acc.dtype, 0, 0)[:3]
    parts = []
    for r in range(transport.size):
        theirs = Message(ops.xp, fields, flat=gathered[r])
        parts.append((theirs["acc"], theirs["m"], theirs["l"]))
    return parts


def decode_bytes(size: int, q) -> int:
    """Bytes one rank sends in `decode`: (G-1) * B*T*H*(D+2) * acc itemsize (q (B,T,H,D))."""
    b, t, h, d = q.shape
    return (size - 1) * b * t * h * (d + 2) * accum_dtype(q.dtype).itemsize

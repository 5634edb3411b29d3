"""Block masks: attention masks given as rectangles over global positions (MagiAttention's
q_ranges, k_ranges and attn_type_map).

A `BlockMask` is a list of n rectangles, rectangle r holding queries [qs, qe) and keys
[ks, ke) of the global sequence, with a kind saying which of its pairs are kept. For query i
and key j inside the rectangle:

    "full"            (code 0)  always
    "causal"          (code 1)  (j - ks) <= (i - qs) + (ke - ks) - (qe - qs): the diagonal through
                                the rectangle's bottom-right corner (flash-attn's convention for
                                unequal lengths), i.e. j - i <= ke - qe
    "inverse_causal"  (code 2)  (j - ks) >= (i - qs): the diagonal through the top-left corner,
                                i.e. j - i >= ks - qs
    "bidir_causal"    (code 3)  both

So every kind keeps the pairs of its box whose offset d = j - i lies in a band [lower, upper]
(`offset_bounds`; +-UNBOUNDED where its kind has no such bound). Rectangles may overlap in
queries (a query sees the union of its rectangles' keys) but no (query, key) pair may be kept by
two rectangles.

The ring steps need the mask cut so that any two rectangles' query ranges are equal or
disjoint, and so are their key ranges (a kernel's tile of rows then belongs to one group of
rectangles): `pieces` trims every rectangle to the rows and keys its band keeps, then cuts it at
every range boundary of the trimmed mask (once, when the mask is made). Two rectangles keep a
common pair only if two of their pieces have the same box and overlapping bands, which is how
the constructor checks it. `burstcu.layout.rectangles` intersects the pieces with the ranks'
segments at each step. The cut is linear in the rectangles where ranges do not nest (documents)
and quadratic where query or key ranges do: n query ranges [s_i, N), or n key ranges [0, s_i),
give n^2 / 2 pieces.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .layout import ragged

KINDS = ("full", "causal", "inverse_causal", "bidir_causal")
MAX_RANGE = 1 << 31     # positions a mask may name (pair counts then fit in int64)
UNBOUNDED = 1 << 40     # an offset bound that never cuts (beyond any position difference)

# one piece of the mask a row: its query and key ranges [start, stop), its offset band
# [lower, upper] (within what the box can reach), and the rectangle it comes from
PIECE = np.dtype([("q_start", np.int64), ("q_stop", np.int64), ("k_start", np.int64),
                  ("k_stop", np.int64), ("lower", np.int64), ("upper", np.int64),
                  ("rect", np.int64)])


def _ranges(x, name: str) -> np.ndarray:
    """x as an (n, 2) int64 array of [start, stop) ranges, 0 <= start < stop <= MAX_RANGE
    (ValueError or TypeError otherwise); any framework's array or a nested sequence."""
    try:   # CuPy to the host, torch tensors through .cpu(), then any array or nested sequence
        if type(x).__module__.split(".")[0] == "cupy":
            x = x.get()
        elif callable(getattr(x, "cpu", None)):
            x = x.cpu()
        arr = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - reported as what it is
        raise TypeError(f"{name} must be an (n, 2) integer array, cannot read it: {exc}") from None
    if arr.size == 0 and (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[1] == 2)):
        return np.zeros((0, 2), np.int64)             # no rectangle ([] included)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name} must be (n, 2) [start, stop) ranges, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    # compared as given, before the cast: unsigned values past int64's range are not wrapped
    bad = np.flatnonzero((arr[:, 0] < 0) | (arr[:, 1] <= arr[:, 0]) | (arr[:, 1] > MAX_RANGE))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"{name}[{r}] = {arr[r].tolist()} is not a range 0 <= start < stop "
                         f"<= 2^31")
    return arr.astype(np.int64)


def _kinds(kinds, n: int) -> np.ndarray:
    """kinds (names of KINDS or their codes 0-3) as an (n,) int8 array."""
    if isinstance(kinds, str):
        raise TypeError(f"kinds must be a sequence of {KINDS} or codes 0-3, one a rectangle, "
                        f"not the string {kinds!r}")
    try:
        items = list(kinds.tolist() if hasattr(kinds, "tolist") else kinds)
    except TypeError:
        raise TypeError(f"kinds must be a sequence of {KINDS} or codes 0-3, got "
                        f"{type(kinds).__name__}") from None
    if len(items) != n:
        raise ValueError(f"kinds has {len(items)} entries for {n} rectangles")
    codes = []
    for r, kind in enumerate(items):
        if isinstance(kind, str) and kind in KINDS:
            codes.append(KINDS.index(kind))
        elif isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and 0 <= kind < 4:
            codes.append(int(kind))
        else:
            raise ValueError(f"kinds[{r}] = {kind!r} is not one of {KINDS} or a code 0-3")
    return np.array(codes, np.int8).reshape(n)


def offset_bounds(q_ranges: np.ndarray, k_ranges: np.ndarray, codes: np.ndarray):
    """(lower, upper) (n,) int64: rectangle r keeps (i, j) of its box iff lower <= j - i <= upper
    (module docstring), -UNBOUNDED / UNBOUNDED where its kind has no such bound."""
    qs, qe = q_ranges[:, 0], q_ranges[:, 1]
    ks, ke = k_ranges[:, 0], k_ranges[:, 1]
    upper = np.where((codes == 1) | (codes == 3), ke - qe, UNBOUNDED)
    lower = np.where((codes == 2) | (codes == 3), ks - qs, -UNBOUNDED)
    return lower, upper


def box_pairs(q0, q1, k0, k1, lower, upper) -> np.ndarray:
    """Pairs (i, j) with q0 <= i < q1, k0 <= j < k1 and lower <= j - i <= upper, counted in
    closed form for every row of the (broadcast) arrays (int64): the pairs with j - i <= upper
    less those with j - i <= lower - 1 (`_at_or_below`). Positions below 2^31."""
    q0, q1, k0, k1, lower, upper = np.broadcast_arrays(
        *(np.asarray(a, np.int64) for a in (q0, q1, k0, k1, lower, upper)))
    kept = _at_or_below(q0, q1, k0, k1, upper) - _at_or_below(q0, q1, k0, k1, lower - 1)
    return np.where((q1 > q0) & (k1 > k0), np.maximum(kept, 0), 0)


def _at_or_below(q0, q1, k0, k1, c) -> np.ndarray:
    """Pairs of the box [q0, q1) x [k0, k1) with j - i <= c. Row i keeps clip(i + c - k0 + 1, 0,
    n_k) keys: summed over the rows, T(a + n_q - 1) - T(a - 1) with a = q0 + c - k0 + 1 and
    T(x) = sum_{t=0..x} clip(t, 0, n_k) (0 for x < 0)."""
    n_q, n_k = np.maximum(q1 - q0, 0), np.maximum(k1 - k0, 0)
    c = np.clip(c, k0 - q1, k1 - q0)     # beyond these every pair, or none, is at or below c
    a = q0 + c - k0 + 1

    def total(x):
        x = np.maximum(x, -1)
        within = np.minimum(x, n_k)
        return within * (within + 1) // 2 + np.maximum(x - n_k, 0) * n_k

    return total(a + n_q - 1) - total(a - 1)


def _band_in_box(q0, q1, k0, k1, lower, upper):
    """The band [lower, upper] clipped to the offsets j - i the box [q0, q1) x [k0, k1) holds:
    (lower', upper'), empty where lower' > upper'."""
    return np.maximum(lower, k0 - (q1 - 1)), np.minimum(upper, (k1 - 1) - q0)


class BlockMask:
    """A mask over global positions as n rectangles (module docstring).

    q_ranges, k_ranges: (n, 2) integer arrays (any framework) of [start, stop) ranges of global
        query and key positions (below 2^31); kinds: n names of KINDS or their codes 0-3.
    Raises ValueError/TypeError for a malformed mask, and ValueError naming a (query, key) pair
    two rectangles both keep. Hashable and comparable by content (equal masks are one cache
    entry); read-only. n = 0 keeps nothing.
    """

    def __init__(self, q_ranges, k_ranges, kinds):
        q = _ranges(q_ranges, "q_ranges")
        k = _ranges(k_ranges, "k_ranges")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q_ranges has {q.shape[0]} rectangles, k_ranges {k.shape[0]}")
        codes = _kinds(kinds, q.shape[0])
        for a in (q, k, codes):
            a.flags.writeable = False
        self._q, self._k, self._codes = q, k, codes
        self._key = q.tobytes() + k.tobytes() + codes.tobytes()
        self._pieces = self._cut()

    q_ranges = property(lambda self: self._q, doc="(n, 2) int64 query ranges [start, stop)")
    k_ranges = property(lambda self: self._k, doc="(n, 2) int64 key ranges [start, stop)")
    codes = property(lambda self: self._codes, doc="(n,) int8 kind codes (KINDS' indices)")
    pieces = property(lambda self: self._pieces, doc="the PIECE rows (module docstring)")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(KINDS[c] for c in self._codes.tolist())

    def __len__(self) -> int:
        return int(self._codes.size)

    def __eq__(self, other):
        if not isinstance(other, BlockMask):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self):
        return BlockMask, (self._q, self._k, self._codes)

    def __repr__(self) -> str:
        head = ", ".join(f"q{tuple(q)} k{tuple(k)} {kind}" for q, k, kind in
                         zip(self._q.tolist()[:3], self._k.tolist()[:3], self.kinds))
        return f"BlockMask({self._count()}{': ' + head if head else ''}" \
               f"{', ...' if len(self) > 3 else ''})"

    def _count(self) -> str:
        return f"{len(self)} rectangle{'' if len(self) == 1 else 's'}"

    @property
    def digest(self) -> str:
        """What ranks agree on: the count and a hash of the rectangles."""
        return f"{self._count()}, sha1 {hashlib.sha1(self._key).hexdigest()[:16]}"

    @property
    def extent(self) -> int:
        """The first position past every range (0 for no rectangle): N must be at least this."""
        if not len(self):
            return 0
        return int(max(self._q[:, 1].max(), self._k[:, 1].max()))

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) of every rectangle (`offset_bounds`)."""
        return offset_bounds(self._q, self._k, self._codes)

    def kept_pairs(self) -> int:
        """The (query, key) pairs the mask keeps, counted exactly."""
        p = self._pieces
        return int(box_pairs(p["q_start"], p["q_stop"], p["k_start"], p["k_stop"], p["lower"],
                             p["upper"]).sum())

    def row_pairs(self, seqlen: int) -> np.ndarray:
        """(seqlen,) int64: the keys each query position sees (its share of the work), in time
        linear in the pieces and seqlen. A piece adds to its rows i in [q0, q1) the trapezoid
        clip(min(k1 - 1, i + upper) - max(k0, i + lower) + 1, 0): 0 up to a, rising by 1 a row
        to its height h at b = a + h, flat to c, falling to 0 at d; it goes in as the jumps at
        the piece's first and last row and the slopes between, both difference arrays."""
        if self.extent > seqlen:
            raise ValueError(f"the mask reaches position {self.extent - 1}, past {seqlen} rows")
        p = self._pieces
        q0, q1, k0, k1 = p["q_start"], p["q_stop"], p["k_start"], p["k_stop"]
        lower, upper = p["lower"], p["upper"]

        def trapezoid(i):
            return np.maximum(np.minimum(k1 - 1, i + upper) - np.maximum(k0, i + lower) + 1, 0)

        height = np.minimum(upper - lower + 1, k1 - k0)
        a = k0 - upper - 1
        d = k1 - lower
        jumps = np.zeros(seqlen + 2, np.int64)      # F(i) - F(i - 1) at a piece's edges
        slopes = np.zeros(seqlen + 2, np.int64)     # the slope's own differences
        np.add.at(jumps, q0, trapezoid(q0))
        np.add.at(jumps, q1, -trapezoid(q1 - 1))
        for first, last, step in ((a + 1, a + height, 1), (d - height + 1, d, -1)):
            lo, hi = np.maximum(first, q0 + 1), np.minimum(last, q1 - 1)
            some = lo <= hi
            np.add.at(slopes, lo[some], step)
            np.add.at(slopes, hi[some] + 1, -step)
        return np.cumsum(jumps + np.cumsum(slopes))[:seqlen]

    def balanced_lengths(self, size: int, seqlen: int) -> tuple[int, ...]:
        """Rows each of `size` ranks holds, in contiguous order, so that the rank whose queries
        keep the most pairs keeps as few as any contiguous split allows (at least one row a
        rank); within that, rank by rank, each cut falls as near as the cuts before it allow to
        where the running count of kept pairs passes r/size of the total. That balances the
        compute of the forward on every strategy and of the backward where it runs on the
        queries' rank (ring, allgather, Ulysses); burst's backward computes on the rank holding
        the keys, balanced too only where the mask keeps about as many pairs a key row as a
        query row. Give them to `burstcu.Sharding(group, lengths=...)`, or
        `burstcu.shard(..., block_mask=...)` cuts them itself."""
        if not 1 <= size <= seqlen:
            raise ValueError(f"{seqlen} rows cannot be split over {size} ranks")
        return _balanced_split(self.row_pairs(seqlen), size)

    def _cut(self) -> np.ndarray:
        """The PIECE rows: each rectangle trimmed to the rows and keys its band keeps (dropped if
        it keeps none), then cut at every range boundary of the trimmed rectangles; pieces that
        keep nothing dropped, bands clipped to their boxes. ValueError if two rectangles keep a
        common pair (then two pieces share a box and their bands overlap)."""
        lower, upper = self.bounds
        qs, qe, ks, ke = self._q[:, 0], self._q[:, 1], self._k[:, 0], self._k[:, 1]
        q0 = np.maximum(qs, ks - upper)                 # rows with a key in the band ...
        q1 = np.minimum(qe, ke - lower)
        k0 = np.maximum(ks, qs + lower)                 # ... and keys some row sees
        k1 = np.minimum(ke, qe + upper)
        live = np.flatnonzero((q0 < q1) & (k0 < k1))
        q_box = np.stack([q0[live], q1[live]], axis=1)
        k_box = np.stack([k0[live], k1[live]], axis=1)
        q_sub, q_of = _cut_at_edges(q_box)
        k_sub, k_of = _cut_at_edges(k_box)
        # every (query sub-range, key sub-range) pair of the same rectangle
        k_first = np.searchsorted(k_of, np.arange(live.size), "left")
        k_count = np.searchsorted(k_of, np.arange(live.size), "right") - k_first
        qi, ki = ragged(k_first[q_of], k_count[q_of])
        r = live[q_of[qi]]
        out = np.empty(qi.size, PIECE)
        out["q_start"], out["q_stop"] = q_sub[qi, 0], q_sub[qi, 1]
        out["k_start"], out["k_stop"] = k_sub[ki, 0], k_sub[ki, 1]
        out["lower"], out["upper"] = _band_in_box(out["q_start"], out["q_stop"], out["k_start"],
                                                  out["k_stop"], lower[r], upper[r])
        out["rect"] = r
        out = out[out["lower"] <= out["upper"]]
        self._check_disjoint(out)
        out.flags.writeable = False
        return out

    def _check_disjoint(self, pieces: np.ndarray) -> None:
        """ValueError naming a pair two rectangles both keep: pieces of one box, sorted by their
        bands' lower ends, must each start past every band before it."""
        box = ("q_start", "q_stop", "k_start", "k_stop")
        order = np.lexsort((pieces["lower"],) + tuple(pieces[f] for f in reversed(box)))
        p = pieces[order]
        same = np.ones(p.size, bool) if p.size else np.zeros(0, bool)
        for f in box:
            same[1:] &= p[f][1:] == p[f][:-1]
        same[:1] = False
        for start in np.flatnonzero(same[1:] & ~same[:-1]) if p.size > 1 else []:
            stop = start + 1
            while stop < p.size and same[stop]:
                stop += 1
            group = p[start:stop]
            reach = np.maximum.accumulate(group["upper"])
            hit = np.flatnonzero(group["lower"][1:] <= reach[:-1])
            if hit.size:
                second = group[hit[0] + 1]
                first = group[int(np.argmax(group["upper"][:hit[0] + 1] >= second["lower"]))]
                d = int(second["lower"])
                i = max(int(second["q_start"]), int(second["k_start"]) - d)
                self._refuse(int(first["rect"]), int(second["rect"]), i, i + d)

    def _refuse(self, a: int, b: int, i: int, j: int) -> None:
        a, b = sorted((a, b))
        raise ValueError(
            f"rectangles {a} ({self._q[a].tolist()} x {self._k[a].tolist()}, {self.kinds[a]}) "
            f"and {b} ({self._q[b].tolist()} x {self._k[b].tolist()}, {self.kinds[b]}) both "
            f"keep the pair (query {i}, key {j}): a pair may be kept by one rectangle only")


def _cut_at_edges(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every range cut at every boundary of `ranges` inside it: (sub-ranges (m, 2), the range
    each belongs to (m,), ascending)."""
    edges = np.unique(ranges.reshape(-1))
    first = np.searchsorted(edges, ranges[:, 0], "left")
    count = np.searchsorted(edges, ranges[:, 1], "left") - first
    of, at = ragged(first, count)
    return np.stack([edges[at], edges[at + 1]], axis=1), of


def _balanced_split(work: np.ndarray, size: int) -> tuple[int, ...]:
    """Lengths of `size` contiguous non-empty parts of the rows whose costs are `work` (N,),
    N >= size, minimising the largest part's cost: the least bound B for which the greedy
    split (each part as long as B allows) needs at most `size` parts, found by bisection.
    Then, rank by rank, the cut nearest where the running cost passes r/size of the total
    (ties: the earlier row), among the cuts that keep this part within B and leave the rest
    splittable within B into a row a rank at least (given the cuts before it: nearest one cut
    at a time, not jointly). `first[k]`: the earliest start from which the rest splits into k
    parts within B (the greedy from the end). Arithmetic on the totals in Python integers."""
    n = work.size
    running = np.concatenate([[0], np.cumsum(work)])       # running[i]: cost of rows [0, i)
    total = int(running[-1])

    def ends_from(start: int, bound: int) -> int:          # the greedy part's end from `start`
        reach = min(int(running[start]) + bound, total)
        return int(np.searchsorted(running, reach, "right")) - 1

    def parts(bound: int) -> int:
        count, start = 0, 0
        while start < n and count <= size:
            start, count = ends_from(start, bound), count + 1
        return count

    low, high = max(int(work.max()), -(-total // size)), total
    while low < high:                                       # least bound needing <= size parts
        mid = (low + high) // 2
        low, high = (low, mid) if parts(mid) <= size else (mid + 1, high)
    bound = low
    first = [n]                                             # first[k]: rows [first[k], n) in k
    for _ in range(size - 1):                               # parts within `bound`
        reach = max(int(running[first[-1]]) - bound, 0)
        first.append(int(np.searchsorted(running, reach, "left")))
    cuts, start = [], 0
    for r in range(size - 1):
        left = size - 1 - r                                 # ranks after this one
        lo, hi = max(start + 1, first[left]), min(ends_from(start, bound), n - left)
        goal = total * (r + 1)                              # size x the running target
        at = lo + int(np.searchsorted(running[lo:hi + 1], -(-goal // size), "left"))
        near = [c for c in (at - 1, at) if lo <= c <= hi]
        start = min(near, key=lambda c: (abs(size * int(running[c]) - goal), c))
        cuts.append(start)
    return tuple(int(length) for length in np.diff([0, *cuts, n]))

"""burstcu: exact attention over sequences split across ranks (BurstAttention GAO + LAO).

Public API (see `burstcu.api` for shapes and semantics)::

    group = burstcu.init()                        # MPI.COMM_WORLD, backend "auto"
    group = burstcu.init(link=burstcu.Link(gbps=10, latency_us=5))   # MPI paced as that network
    sh = burstcu.Sharding(group, layout="zigzag")  # the split, carried to every call
    q, k, v = (sh.shard(x) for x in (Q, K, V))
    out, lse = burstcu.attention(q, k, v, sh, causal=True, return_lse=True)
    mask = burstcu.BlockMask([[0, 64], [64, 128]], [[0, 64], [0, 128]], ["causal", "causal"])
    out = burstcu.attention(q, k, v, sh, block_mask=mask)   # any mask as rectangles
    OUT = sh.unshard(out)                         # the global output on every rank
    dq, dk, dv = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
    print(burstcu.plan(q.shape, k.shape, group, causal=True))   # which strategy "auto" would pick
    out = burstcu.linear_attention(q, k, v, group, causal=True)   # LASP-2 (linear attention)
    out = burstcu.decode(q_new, k_cache, v_cache, group, cache_seqlens=n)   # sharded KV cache
    out = burstcu.jax.attention(q, k, v, group, causal=True)     # jax.grad / jax.jit (extra "jax")
    out = burstcu.torch.attention(q, k, v, group, causal=True)   # torch autograd (extra "torch")

The house (docs/repository.md): api.py is the public face; engine/ holds one module a
strategy, written against two interfaces, ops/base.py's LocalOps (numpy/, cuda/) and
transport/base.py's Transport (mpi, nccl, torch_dist, loopback); group.py alone picks them;
build/ compiles the kernels of kernels/; testing/ verifies, imported only by the checking entry points
(demo.py, selftest.py).
"""

from .api import (attention, attention_backward, decode, linear_attention,
                  linear_attention_backward, shard, unshard)
from .blockmask import BlockMask
from .kvcache import KVCache
from .group import Group, init
from .plan import plan
from .sharding import Sharding
from .transport.base import CommTimeoutError, PeerFailedError
from .transport.link import Link
from .validate import CallSiteWarning, HeadsAxisWarning, SameShardsWarning, ordered_by

__all__ = ["init", "Group", "Sharding", "BlockMask", "attention", "attention_backward", "linear_attention",
           "linear_attention_backward", "shard", "unshard", "plan", "decode", "KVCache",
           "CommTimeoutError", "PeerFailedError", "Link", "SameShardsWarning", "HeadsAxisWarning",
           "CallSiteWarning", "ordered_by"]
__version__ = "0.1.0"

# the autodiff adapters import their framework: loaded on first use (`burstcu.jax.attention`)
_ADAPTERS = ("jax", "torch")


def __getattr__(name: str):
    if name in _ADAPTERS:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'burstcu' has no attribute {name!r}")

import time, cProfile, pstats, torch, cupy, burstcu
S, H, D = 4096, 16, 128
x = [torch.randn(1, S, H, D, device="cuda", dtype=torch.float16) for _ in range(4)]
leaves = [t.clone().requires_grad_() for t in x[:3]]
c = [cupy.from_dlpack(t) for t in x]
def api():
    out, lse = burstcu.attention(*c[:3], causal=True, return_lse=True)
    burstcu.attention_backward(c[3], *c[:3], out, lse, causal=True)
def tor():
    out = burstcu.torch.attention(*leaves, causal=True); out.backward(x[3])
def fwd_only():
    with torch.no_grad():
        burstcu.torch.attention(*x[:3], causal=True)
def api_fwd():
    burstcu.attention(*c[:3], causal=True)
for f in (api, tor, api_fwd, fwd_only):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): f()
    torch.cuda.synchronize(); print(f.__name__, (time.perf_counter() - t) / 20 * 1e3, "ms", flush=True)
    t = time.perf_counter()
    for _ in range(20): f()
    print(f.__name__, "host only (no sync)", (time.perf_counter() - t) / 20 * 1e3, "ms", flush=True)
    torch.cuda.synchronize()
cProfile.run("for _ in range(20): tor()\ntorch.cuda.synchronize()", "/tmp/p.out")
pstats.Stats("/tmp/p.out").sort_stats("tottime").print_stats(25)

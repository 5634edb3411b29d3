/*
flash_fwd_sm90.cu — the forward step of the local attention on Hopper (sm_90a): wgmma, bulk tensor
copies (TMA), mbarriers and warp specialisation.

ALGORITHM
The same fold as flash_fwd.cu's flash_fwd_step (read its opening comment first): the fp32 running
state (acc, m, l) of the local query rows is read, one K/V rectangle (a burstcu.layout.Block) is
folded into it with the online softmax in base 2, and the state is written back; the ring's merge
is fused, flash_fwd_finalize (flash_fwd.cu) ends the pass. A rectangle over every query row of the
state may also start and end the pass (p.fresh: the state is not read, acc 0, m -inf, l 0 in
registers; p.finalize: out and lse are written with flash_fwd_finalize's arithmetic instead of the
state; with both, a pass of one fold, one rank's call or Ulysses', is this one kernel where it was
three zeroings, the fold and the finalize; a tile without keys then writes its rows all the same).
What changes is how the work is fed to the tensor cores, following FlashAttention-3:
  * one block = 3 warpgroups of 128 threads on a persistent grid: warpgroup 0 is the producer
    (one elected thread of its warp 0 issues every copy; its registers are given away with
    setmaxnreg.dec), warpgroups 1 and 2 are consumers, 64 query rows each (BLOCK_M = 128 a tile);
  * the producer copies the Q tile and, for every key tile, the K and V tiles with
    cp.async.bulk.tensor (tensor maps built on the host, 128-byte swizzle) into a ring of STAGES
    shared buffers; each copy completes its bytes on a "full" mbarrier, and the consumers free a
    stage by arriving on its "empty" mbarrier;
  * the consumers compute S = Q K^T with wgmma (both operands in shared memory, K-major) and
    O += P V with wgmma (P from registers: the S accumulator re-packed as A fragments, V in shared
    memory read N-major, i.e. transposed by the instruction), fp32 accumulation throughout;
  * within a consumer, the softmax of key tile j overlaps the tensor cores: S_{j+1} = Q K_{j+1}^T
    and O += P_j V_j are issued together, wgmma.wait_group 1 returns when S_{j+1} is ready, and
    its softmax runs while P_j V_j is still in flight; O is rescaled after wait_group 0;
  * the two consumers take turns issuing their GEMMs (named barriers 1 and 2, "ping-pong"), so
    that one warpgroup's softmax runs while the other's GEMMs occupy the tensor cores;
  * tiles (query block, head, batch) are handed out round-robin over the persistent grid, query
    blocks with the most keys first when the rectangle has a causal or window bound, a group of
    p.hb_group (batch, head) pairs at a time (tile_coord; KernelOps.sm90_head_group, all pairs
    unless set).

RECTANGLE LISTS (flash_fwd_steps_sm90, LIST = true; flash_fwd_step_sm90 is the same body with LIST
false, its SASS of the same length)
A ring step of many rectangles (packed documents) runs in one launch, on the StepGroups that
flash_fwd.cu's flash_fwd_steps takes (rects grouped by query range, each group's in order; the
groups' first rectangles and first query tiles, step_group_of in params.cuh). The tensor maps
cover the whole q, k and v arrays, built once a launch; a rectangle's rows are reached through
the copies' row coordinates (q_start + 128 mb, k_start + BLOCK_N j). A work item is a query tile
of a group x head x batch (tiles of all groups taken last to first: under a causal bound the
longest first); the producer and the consumers walk the same key tiles (next_key_tile): those of
the group's first live rectangle, then of the next one's, ..., so the stages and phases run on
across rectangles, and a consumer issues the next rectangle's first Q K^T together with the last
P V of the one before, the software pipeline unbroken. Each rectangle's masks are its own (its
k_pos - q_pos, lo, hi, k_len). At a rectangle's first tile the consumers reduce their partial row
sums over the row group (thread tq == 0 keeps the sum) as writing and re-reading the state
between two launches would, so a list gives the state of one launch a rectangle bit for bit (a
packed list within rounding: MASKS below). The Q tile is freed after the last live rectangle's
last Q K^T. Rows past a rectangle's k_len are now the arrays' next rows, not zeros: their scores
are masked (-inf whatever K holds), and a non-finite V there would reach a row as 0 x Inf, so a
list with a key count off BLOCK_N launches the careful pair as a list with masked pairs does
(KernelOps._fold). Rows past q_len are another group's: they are computed and never written.

PIPELINE (one consumer warpgroup; the producer runs STAGES key tiles ahead)
    producer:  Q -> [q_full]      K_j -> [k_full[s]]  V_j -> [v_full[s]]   waits [kv_empty[s]]
    consumer:  wait q_full, k_full[s0];  S = Q K_0^T;  softmax -> P_0
               for j = 1 .. n-1:
                   wait k_full[s_j];  issue S = Q K_j^T           (group a)
                   wait v_full[s_j-1]; issue O += P_{j-1} V_{j-1}  (group b)
                   wait_group 1 (S ready)  -> mask, max, exp2 -> P_j, row sums
                   wait_group 0 (O ready)  -> arrive kv_empty[s_j-1]; O *= alpha_j
               wait v_full; O += P_{n-1} V_{n-1}; arrive kv_empty; write acc, m, l
    q_empty is arrived once a tile's last Q K^T has completed, letting the producer load the next Q.
    In the SASS (NVRTC 13.0) only the mask and the row max sit between the two waits: ptxas moves
    the exp2 and the row sums below wait_group 0, so a warpgroup's softmax overlaps the other
    warpgroup's products (the two take turns issuing: named barriers my_turn / their_turn), not
    its own P V. ptxas moves independent ALU work across a wait freely, but not below a product
    that reads it (the backward's dV, flash_bwd_sm90.cu). Tried without effect: a wgmma.fence or
    the operands' register fence before the wait, O's rescale moved before the next P V's issue;
    a wait predicated on the row sums made ptxas serialize every wgmma.

SOFTMAX SHIFT
P = exp2(s * scale_log2 - ref) is one FFMA an element (FlashAttention-3's form), ref the row max
already scaled and rounded. The FFMA rounds once, after the subtraction, so the max's own P is
exp2(e), e = its exact scaled score - ref, up to half an ulp of ref. While |ref| < 2^13,
|e| <= 2^-12 and that P rounds to exactly 1 in the 16-bit P of P V, as the reference's does; past
it a row with one dominant key comes out up to an output ulp off, and past 2^31 (ulps of 256) P
under- or overflows: a row sum of 0 or inf, lse -inf or +inf and out NaN for rows that see keys.
A row whose |ref| reaches 2^12 (kFusedShiftBelow, a binade short of 2^13: scores of ~2800 at
scale 1) therefore scales
first and subtracts (FMUL, FADD), as ref itself was made, so its max's P is exactly 1, as
flash_fwd.cu's always is; the test is once a row a tile, and false on ordinary scores.

SHARED MEMORY (dynamic, aligned to 1024 bytes in the shared window by the kernel itself)
    Q tile  BLOCK_M x D, K and V tiles BLOCK_N x D per stage, each stored as D/64 column blocks of
    rows x 64 elements (128 bytes a row, the 128-byte swizzle pattern repeating every 8 rows =
    1024 bytes), exactly what a TMA box of (64, rows) with CU_TENSOR_MAP_SWIZZLE_128B writes and
    what a wgmma descriptor with the 128-byte swizzle mode reads. Then (CAREFUL) the non-finite
    marks, then the mbarriers.
    D     BLOCK_N  STAGES   smem (bytes, burstcu/build/fwd_variants.py: sm90_smem_bytes)
    64    128      3        1024 + (128 + 768) x 128 + 256   = 115968
    128   128      3        1024 + (128 + 768) x 256 + 256   = 230656   (of 232448)
    256   64       2        1024 + (128 + 256) x 512 + 256   = 197888
    The CAREFUL twin's marks (STAGES x D x BLOCK_N bits) do not fit beside a third stage at d = 128:
    it runs 2 (fwd_variants.careful_twin); the stages change when copies land, not the arithmetic.
    Registers: __launch_bounds__(384, 1) gives 168 a thread at launch (the gate checks it); the
    producer keeps 24, the consumers 240 each (128 x 24 + 256 x 240 = 64512 = 384 x 168; CAREFUL:
    40 and 232). A consumer thread holds O (D/2 fp32), S (BLOCK_N/2
    fp32) and P (BLOCK_N/4 u32 A fragments).

MASKS AND THE CAREFUL TWIN
Masks are flash_fwd_step's: scores of masked pairs are -inf whatever K holds, rows and keys past
q_len / k_len read zeros (the tensor maps cover only the rectangle, and TMA fills outside them with
zeros). A packed list (LIST, p.row_keys set: params.cuh; one rectangle a group, no key bound)
masks each query row to its run of keys too, in every tile; its tiles cut the keys otherwise than
the rectangles' launches, so its state is theirs within rounding, not bit for bit. A non-finite V
at a masked key would still reach a row through 0 x Inf in P V: blocks with masked pairs (and
packed lists) launch the pair <..., false> and <..., true> (CAREFUL), and the nonfinite flag runs
exactly one. In the CAREFUL twin the whole producer warpgroup waits for each V tile, replaces its
Inf/NaN values by 0 and records, per head dim, the keys where they were (BLOCK_N bits each, after
the V stages in shared memory), then fences the generic-proxy writes (fence.proxy.async), meets at
named barrier 3 and arrives on v_clean[s], which the consumers wait for instead of v_full[s].
After each P V the consumers turn into NaN every output that a recorded value reaches through a
non-zero rounded weight (flash_fwd.cu's gemm_rs_masked does the same): on finite tiles the twin
is the plain kernel bit for bit. It runs only where V holds Inf/NaN; its speed does not matter.

BUILD
    python -m burstcu.build check --arch sm_90a --json gate.json   (NVRTC, sm_90a: wgmma and
    setmaxnreg need the "a" target; the gate reads the SASS for HGMMA and local memory)
    CPU emulator: burstcu.init(backend="emulated", arch="sm_90a") (kernels/emu/emu_hopper.h,
    emu_wgmma.h implement every primitive of hopper.cuh)

TWO NUMBERS
Forward, non-causal, S = 16384, d = 128, B x H = 16: 4 S^2 d B H = 2.25e12 FLOP; at the ~790
TFLOP/s a large bf16 GEMM reaches on an H100/H200 (the device notes) the floor is 2.8 ms. Bytes:
Q, K, V in and the fp32 state (acc read and written, m, l) = 0.34 GB, 0.1 ms: matrix-bound.

MEASURED (one H200, 2026-11-27, bench/results/h200/, bench/gpu/kernel_speed.py: init + one step +
finalize, CUDA events, torch 2.11's flash and cuDNN backends in the same run)
    first run (the tile table above as planned, untuned): d = 128 S = 16K 303-306 TFLOP/s
      (0.87-0.90x torch flash, 0.46-0.49x cuDNN). Nsight Compute (run2's logs): tensor pipe
      35% busy, 9 of 12 warps active, 0.38 eligible a scheduler; 1.97e9 instructions, ~15 an
      attention score: the mask test sat inside the element loop (a branch region an element,
      masked or not) and the scale was a separate FMUL; the f32 -> f16 packing took two cvt and
      a PRMT (SASS of the sources at 2e1e255).
    now (the mask in a loop of its own for the tiles that cross a bound, the scale folded into
      one FFMA with the max taken over raw scores, one cvt.rn.f16x2.f32 a pair):
      d      S=4K fp16/bf16   S=16K fp16/bf16   vs torch flash (16K)   vs cuDNN (16K)
      64     265 / 293        379 / 424         1.29 / 1.39x           0.81 / 0.87x
      128    291 / 349        435 / 470         1.28 / 1.39x           0.69 / 0.72x
      256    338 / 355        471 / 465         1.50 / 1.45x           0.66 / 0.64x
    causal at 16K: 322-386 TFLOP/s (1.14-1.33x torch flash). Target: 1.6x torch flash at d = 128
      (~540 TFLOP/s against that run's torch flash, 339 bf16): not met.
    run4 (bench/results/h200/run4): the tile search put a third K/V stage at d = 128 ahead, the
      step alone 1.12x (fp16, 16K: 524 against 467 TFLOP/s) to 1.19x (4K); the table now has it.
      Nsight Compute: tensor pipe 54% busy (35% in the first version), 1.22e9 instructions. At
      S = 1K (B = 16, d = 128) the finalize took 183 us beside the step's 401 (one thread an
      element at 1.1 TB/s); it now moves 8 elements a thread (flash_fwd.cu): 47 us.
    run6 (3 stages at d = 128, the finalize 8-wide, less host work a call), d = 128 fp16 / bf16:
      S      whole call TFLOP/s   vs torch flash   vs cuDNN      step kernel alone (ncu, fp16)
      4K     462 / 485            1.34 / 1.43x     0.76 / 0.77x  1008 us: 1.54x flash, 0.84x cuDNN
      8K     544 / 571            1.60 / 1.62x     0.86 / 0.86x
      16K    591 / 611            1.74 / 1.71x     0.94 / 0.91x  3521 us: 1.73x flash, 0.94x cuDNN
      causal 16K 468 / 521 (1.47 / 1.63x flash); the step alone 1.83x flash, 0.96x cuDNN.
    The target (1.6x torch flash at S >= 4K) holds from 8K up; at 4K the step kernel reaches
    1.54x but a call spends ~0.18 ms beside it (the finalize, zeroing the state, host gaps).
    run6's profile at S = 4K (B = 4, H = 16): 38% L2 hits and 51% of DRAM's bandwidth, about 2.4
      GB moved for ~0.37 GB of inputs and state: with every (batch, head) pair's first query
      blocks running at once, 132 tiles read the K/V of 64 pairs (128 MB, beyond the 50 MB L2),
      two tiles of each. PREDICTION: taking the tiles a few pairs at a time (hb_group 2-8, run.sh
      head_groups) keeps a pair's K/V in L2 for its 32 query blocks.
NEXT (in order of the expected gain): the rectangle lists above, measured against the mma.sync
list kernel (KernelOps.sm90_lists = False) on a step of documents;
the head groups above, measured; the pass of one fold (p.fresh and p.finalize, not yet run on a
GPU: PREDICTION ~0.15 ms less a call at 4K, the fp32 state neither zeroed, read, written nor
finalized; run.sh whole_pass times it against whole_pass off);
BLOCK_N = 176 at d = 128; S <= 2K (the step alone 0.6-0.7x cuDNN); the softmax's exp2 under the
warpgroup's own P V (PIPELINE above): where no row of the warpgroup raised its max (alpha = 1
exactly, a warpgroup vote), P_j V_j could be issued before P_{j-1} V_{j-1} retires (P's A
fragments double-buffered), so that a product reads the exp2 before the wait, as the
backward's dV does; to be weighed against the two warpgroups' turns, which cover it today.
*/

#include "hopper.cuh"

namespace fwd90 {

constexpr int kBlockM = 128;     // query rows a tile: two consumer warpgroups
constexpr int kWgRows = 64;      // query rows a consumer warpgroup (one wgmma m64)
constexpr int kThreads = 384;    // producer warpgroup + two consumers
constexpr int kColBlock = 64;    // elements of a 128-byte swizzled column block
constexpr int kConsumers = 256;  // threads that arrive on the empty barriers
constexpr float kFusedShiftBelow = 4096.f;  // 2^12: a |scaled row max| past it scales first (SOFTMAX SHIFT)
// registers a thread after setmaxnreg (128 x producer + 256 x consumer <= 65536); the CAREFUL
// producer also cleans V tiles, and gets more
template <bool CAREFUL> struct Regs {
  static constexpr int kProducer = CAREFUL ? 40 : 24, kConsumer = CAREFUL ? 232 : 240;
};
constexpr int kPingPongBar = 1;  // named barriers 1 and 2: the consumers' turns
constexpr int kCleanBar = 3;     // named barrier 3: the producer warpgroup cleaned a V tile (CAREFUL)

__device__ __forceinline__ float neg_inf() { return -INFINITY; }

// Byte offsets inside the (1024-aligned) dynamic shared memory.
template <int HEADDIM, int BLOCK_N, int STAGES, bool CAREFUL>
struct Smem {
  static constexpr int kQBytes = kBlockM * HEADDIM * 2;
  static constexpr int kTileBytes = BLOCK_N * HEADDIM * 2;  // one K or one V tile
  static constexpr int kQ = 0;
  static constexpr int kK = kQBytes;                         // stage s: kK + s * kTileBytes
  static constexpr int kV = kK + STAGES * kTileBytes;        // stage s: kV + s * kTileBytes
  // CAREFUL: per stage and head dim d, the keys whose V[key][d] was not finite, BLOCK_N bits
  static constexpr int kMaskWords = BLOCK_N / 32;
  static constexpr int kNf = kV + STAGES * kTileBytes;       // stage s: kNf + s * kNfBytes
  static constexpr int kNfBytes = CAREFUL ? HEADDIM * kMaskWords * 4 : 0;
  static constexpr int kBars = kNf + STAGES * kNfBytes;      // the mbarriers (u64 each)
  // q_full, q_empty, then k_full[STAGES], v_full[STAGES], kv_empty[STAGES], v_clean[STAGES]
  static constexpr int kNumBars = 2 + 4 * STAGES;
  static constexpr int kBytes = 1024 + kBars + 256;          // = fwd_variants.sm90_smem_bytes
  static_assert(kNumBars * 8 <= 256, "barriers fit their 256 bytes");
  static_assert(kQBytes % 1024 == 0 && kTileBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

// The barriers, in Smem's order.
template <int STAGES>
struct Barriers {
  u64 *q_full, *q_empty, *k_full, *v_full, *kv_empty, *v_clean;
  __device__ __forceinline__ explicit Barriers(u64* bars)
      : q_full(bars), q_empty(bars + 1), k_full(bars + 2), v_full(bars + 2 + STAGES),
        kv_empty(bars + 2 + 2 * STAGES), v_clean(bars + 2 + 3 * STAGES) {}
};

// The key tiles [tile_begin, n_key_tiles) some row of query block `mb` may see (flash_fwd_step's
// bounds with BLOCK_M = 128); empty when tile_begin >= n_key_tiles or the block has no row.
template <int BLOCK_N>
struct KeyRange {
  int begin, end;
  __device__ __forceinline__ KeyRange() : begin(0), end(0) {}
  __device__ __forceinline__ KeyRange(const BlockRect& r, int mb) {
    const int q0 = mb * kBlockM;
    const int q_last = min(q0 + kBlockM, r.q_len) - 1;
    const int n_keys = max(0, min(r.k_len, r.q_pos + q_last + r.hi - r.k_pos + 1));
    const int first_key = r.q_pos + q0 - r.lo - r.k_pos;
    begin = first_key > 0 ? first_key / BLOCK_N : 0;
    end = q_last < q0 ? 0 : (n_keys + BLOCK_N - 1) / BLOCK_N;
  }
  __device__ __forceinline__ bool empty() const { return begin >= end; }
};

// Arrivals that complete a phase of barrier i (Smem's order): the full barriers one (the
// producer's arrive.expect_tx; the copies complete the bytes), the empty ones every consumer
// thread, v_clean one (the producer thread that saw its warpgroup finish cleaning V).
template <int STAGES>
struct BarrierCounts {
  __device__ __forceinline__ static u32 of(int i) {
    const bool empty = i == 1 || (i >= 2 + 2 * STAGES && i < 2 + 3 * STAGES);  // q_empty, kv_empty[]
    return empty ? kConsumers : 1;
  }
};

// CAREFUL: V tile `tile` (BLOCK_N keys x HEADDIM, as TMA wrote it: column blocks of 64, 128-byte
// swizzle) loses its non-finite values to 0, and nf[d * kMaskWords + w] gets bit j % 32 of word
// w = j / 32 set for each key j whose V[j][d] was not finite (d = the thread's columns). One
// producer warpgroup (128 threads, ptid) shares the columns; elements past k_len are TMA's zeros.
template <typename T, int HEADDIM, int BLOCK_N>
__device__ __forceinline__ void clean_v_tile(unsigned char* tile, u32* nf, int ptid) {
  constexpr int kWords = BLOCK_N / 32;
  for (int d = ptid; d < HEADDIM; d += 128) {
    const int cb = d / kColBlock, chunk = (d % kColBlock) / 8, e = d % 8;
    for (int w = 0; w < kWords; ++w) {  // keys 32w .. 32w + 31, one mask word
      u32 word = 0;
      for (int jj = 0; jj < 32; ++jj) {
        const int j = 32 * w + jj;
        // 128-byte swizzle: the 16-byte chunk c of row j sits at chunk c ^ (j % 8) (tiles are
        // 1024-byte aligned, so address bits and row bits agree)
        u16* x = reinterpret_cast<u16*>(tile + cb * BLOCK_N * 128 + j * 128 + ((chunk ^ (j % 8)) * 16) + e * 2);
        if ((u32(*x) & ExponentBits<T>::kMask) == ExponentBits<T>::kMask) {  // Inf or NaN
          *x = 0;
          word |= 1u << jj;
        }
      }
      nf[d * kWords + w] = word;
    }
  }
}

// The persistent grid's work: tile t -> (query block, head, batch), heads and batches fastest;
// with a causal or window bound (hi below NO_BOUND) the query blocks run last to first, which
// under a causal mask is longest first.
// Computed from the parameters at each tile (constant-bank operands, no registers held across
// the tile loop, where the d = 256 consumers have none to spare).
// Tile t of n_mb query blocks x the (batch, head) pairs -> the i-th query block in the order
// they run, head h, batch b: groups of p.hb_group (batch, head) pairs one after another (the last
// may be smaller); within a group the query blocks slowest and the pairs fastest. One group
// (hb_group = H x B): all pairs' first query blocks, then all pairs' second ones, ...
__device__ __forceinline__ void tile_order(const FwdStepSm90Params& p, int n_mb, int t, int& i, int& h,
                                           int& b) {
  const int hb_count = p.n_tiles / max(1, n_mb);
  const int group_tiles = p.hb_group * n_mb;
  const int g = t / group_tiles;
  const int in_group = min(p.hb_group, hb_count - g * p.hb_group);
  const int u = t - g * group_tiles;
  i = u / in_group;
  const int hb = g * p.hb_group + (u - i * in_group);
  h = hb % p.H;
  b = hb / p.H;
}

__device__ __forceinline__ void tile_coord(const FwdStepSm90Params& p, int t, int& mb, int& h, int& b) {
  const int n_mb = (p.blk.q_len + kBlockM - 1) / kBlockM;
  int i;
  tile_order(p, n_mb, t, i, h, b);
  mb = p.blk.hi < (1 << 29) ? n_mb - 1 - i : i;
}

// LIST: work item t -> a query tile of a group (the groups' tiles, groups[2 n_groups + 1] in all,
// taken last to first: under a causal bound a group's last query tiles see the most keys), head
// h, batch b; mb is the tile within its group, rects[r .. r_end) the group's rectangles.
__device__ __forceinline__ void list_tile_coord(const FwdStepSm90Params& p, int t, int& mb, int& h, int& b,
                                                int& r, int& r_end) {
  const int* groups = p.groups;
  const int n_groups = p.n_groups;
  const int n_mb = groups[2 * n_groups + 1];
  int i;
  tile_order(p, n_mb, t, i, h, b);
  const int gt = n_mb - 1 - i;
  const int g = step_group_of(groups, n_groups, gt);
  mb = gt - groups[n_groups + 1 + g];
  r = groups[g];
  r_end = groups[g + 1];
}

// LIST: the first rectangle of rects[r .. r_end) from r on with a key tile for query block mb,
// copied into rect (r its index); an empty range and r = r_end when there is none.
template <int BLOCK_N>
__device__ __forceinline__ KeyRange<BLOCK_N> live_rect(const BlockRect* rects, int& r, int r_end, int mb,
                                                       BlockRect& rect) {
  for (; r < r_end; ++r) {
    rect = rects[r];
    const KeyRange<BLOCK_N> keys(rect, mb);
    if (!keys.empty()) return keys;
  }
  return KeyRange<BLOCK_N>();
}

// LIST: whether a rectangle of rects(r .. r_end) after r has a key tile for query block mb.
template <int BLOCK_N>
__device__ __forceinline__ bool live_after(const BlockRect* rects, int r, int r_end, int mb) {
  while (++r < r_end)
    if (!KeyRange<BLOCK_N>(rects[r], mb).empty()) return true;
  return false;
}

// Work item t, shared by the producer and the consumers: its query tile mb, head h, batch b and
// the key tiles of its first rectangle with any (empty: nothing to fold); LIST: rects[r .. r_end)
// its group's, r that rectangle's index, copied into cur.
template <bool LIST, int BLOCK_N>
__device__ __forceinline__ KeyRange<BLOCK_N> first_key_range(const FwdStepSm90Params& p, int t, int& mb,
                                                             int& h, int& b, int& r, int& r_end,
                                                             BlockRect& cur) {
  if constexpr (LIST) {
    list_tile_coord(p, t, mb, h, b, r, r_end);
    return live_rect<BLOCK_N>(p.rects, r, r_end, mb, cur);
  } else {
    tile_coord(p, t, mb, h, b);
    return KeyRange<BLOCK_N>(p.blk, mb);
  }
}

// The walk over a work item's key tiles, shared by the producer and the consumers: the next key
// tile after j of the rectangle, else (LIST) the first of the group's next live rectangle (r,
// rect and keys move there); false past the last. The pipeline stages simply continue.
template <bool LIST, int BLOCK_N>
__device__ __forceinline__ bool next_key_tile(int& j, KeyRange<BLOCK_N>& keys, const BlockRect* rects, int& r,
                                              int r_end, int mb, BlockRect& rect) {
  if (++j < keys.end) return true;
  if constexpr (LIST) {
    ++r;
    keys = live_rect<BLOCK_N>(rects, r, r_end, mb, rect);
    j = keys.begin;
    return !keys.empty();
  }
  return false;
}

/* The body of flash_fwd_step_sm90 (LIST false: the rectangle p.blk) and flash_fwd_steps_sm90
   (LIST true: the groups' rectangles p.rects, each group's in order, maps of the whole arrays). */
template <typename T, int HEADDIM, int BLOCK_N, int STAGES, bool CAREFUL, bool LIST>
__device__ __forceinline__ void fold(const FwdStepSm90Params& p) {
  using S = Smem<HEADDIM, BLOCK_N, STAGES, CAREFUL>;
  static_assert(HEADDIM % kColBlock == 0, "head dims 64, 128, 256");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128 || BLOCK_N == 256, "wgmma N of S = Q K^T");
  constexpr int kColBlocks = HEADDIM / kColBlock;
  constexpr int kKSteps = HEADDIM / 16;    // k16 steps of Q K^T
  constexpr int kPSteps = BLOCK_N / 16;    // k16 steps of P V
  if ((*p.nonfinite != 0) != CAREFUL) return;  // the other variant of this launch pair runs

  // Nothing computed here stays live across setmaxnreg (a value that did would be spilled around
  // the register reallocation): each role reads the parameters and carves shared memory itself.
  const int tid = threadIdx.x;
  if (tid == 0) {
    u64* bars = reinterpret_cast<u64*>(aligned_smem() + S::kBars);
    for (int i = 0; i < S::kNumBars; ++i) mbar_init(bars + i, BarrierCounts<STAGES>::of(i));
    fence_mbarrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    // ============================== producer ==============================
    setmaxnreg_dec<Regs<CAREFUL>::kProducer>();
    // one thread issues every copy; CAREFUL keeps the whole warpgroup to clean the V tiles
    const bool leader = tid / 32 == 0 && elect_one();
    if (!CAREFUL && !leader) return;
    BlockRect cur;  // LIST: the rectangle being run
    const BlockRect& rect = LIST ? cur : p.blk;  // else read in place: constant-bank operands
    const BlockRect* rects = LIST ? p.rects : nullptr;
    const int H = p.H, Hkv = p.Hkv, n_tiles = p.n_tiles;
    if (leader) {
      tma_prefetch_map(&p.q_map);
      tma_prefetch_map(&p.k_map);
      tma_prefetch_map(&p.v_map);
    }
    unsigned char* smem = aligned_smem();
    const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
    int stage = 0;
    u32 phase = 0, q_phase = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
      int mb, h, b, r = 0, r_end = 1;
      KeyRange<BLOCK_N> keys = first_key_range<LIST, BLOCK_N>(p, t, mb, h, b, r, r_end, cur);
      if (keys.empty()) continue;
      const int hk = h / (H / Hkv);
      if (leader) {  // LIST: the maps cover the whole arrays, rows from the group's q_start
        mbar_wait(bar.q_empty, q_phase ^ 1);
        mbar_arrive_expect_tx(bar.q_full, S::kQBytes);
        const int q_row = (LIST ? rect.q_start : 0) + mb * kBlockM;
        for (int c = 0; c < kColBlocks; ++c)
          tma_load_4d(smem + S::kQ + c * kBlockM * 128, &p.q_map, bar.q_full, c * kColBlock, q_row, h, b);
      }
      int j = keys.begin;
      do {
        unsigned char* v_tile = smem + S::kV + stage * S::kTileBytes;
        if (leader) {
          mbar_wait(bar.kv_empty + stage, phase ^ 1);
          const int k_row = (LIST ? rect.k_start : 0) + j * BLOCK_N;
          mbar_arrive_expect_tx(bar.k_full + stage, S::kTileBytes);
          for (int c = 0; c < kColBlocks; ++c)
            tma_load_4d(smem + S::kK + stage * S::kTileBytes + c * BLOCK_N * 128, &p.k_map,
                        bar.k_full + stage, c * kColBlock, k_row, hk, b);
          mbar_arrive_expect_tx(bar.v_full + stage, S::kTileBytes);
          for (int c = 0; c < kColBlocks; ++c)
            tma_load_4d(v_tile + c * BLOCK_N * 128, &p.v_map, bar.v_full + stage, c * kColBlock, k_row, hk,
                        b);
        }
        if constexpr (CAREFUL) {
          // the tile's non-finite values out (the consumers wait for v_clean, not v_full): the
          // generic-proxy writes are fenced before the tensor cores (async proxy) read them
          mbar_wait(bar.v_full + stage, phase);
          clean_v_tile<T, HEADDIM, BLOCK_N>(v_tile, reinterpret_cast<u32*>(smem + S::kNf + stage * S::kNfBytes),
                                            tid);
          fence_proxy_async();
          named_bar_sync(kCleanBar, 128);
          if (tid == 0) mbar_arrive(bar.v_clean + stage);
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      } while (next_key_tile<LIST>(j, keys, rects, r, r_end, mb, cur));
      q_phase ^= 1;
    }
    return;
  }

  // ============================== consumers ==============================
  setmaxnreg_inc<Regs<CAREFUL>::kConsumer>();
  BlockRect cur;  // LIST: the rectangle being run (its group's q_start, q_len are every one's)
  const BlockRect& rect = LIST ? cur : p.blk;  // else read in place: constant-bank operands
  const BlockRect* rects = LIST ? p.rects : nullptr;
  const int n_tiles = p.n_tiles;
  unsigned char* smem = aligned_smem();
  const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
  u64 *q_full = bar.q_full, *q_empty = bar.q_empty, *k_full = bar.k_full, *kv_empty = bar.kv_empty;
  u64* v_ready = CAREFUL ? bar.v_clean : bar.v_full;  // V tiles the consumers may read
  const int wg = warpgroup - 1;           // 0 or 1: rows wg*64 .. wg*64+63 of a tile
  const int ct = tid - 128 * warpgroup;   // thread within the warpgroup
  const int warp = ct / 32, lane = ct % 32;
  const int g = lane / 4, tq = lane % 4;  // fragment coordinates: row group, thread in group
  const float scale_log2 = p.scale_log2;
  // the running state of tile (b, h), from the parameters where it is used (their constant-bank
  // operands hold no registers across the tile loop)
  auto m_row0 = [&](int b, int h) { return p.m + b * p.ml_stride.b + h * p.ml_stride.h + rect.q_start; };
  auto l_row0 = [&](int b, int h) { return p.l + b * p.ml_stride.b + h * p.ml_stride.h + rect.q_start; };
  auto acc_row0 = [&](int b, int h) {
    return p.acc + b * p.acc_stride.b + (long long)rect.q_start * p.acc_stride.s + h * p.acc_stride.h;
  };

  // wgmma descriptors (kernels/emu/emu_wgmma.h explains the layouts):
  //   Q, K: K-major, 128-byte swizzle; 8-row groups 1024 bytes apart (SBO); a k16 step is +32
  //   bytes inside a 64-element column block, and column block c starts c x rows x 128 bytes on.
  //   V: N-major (transposed by the instruction), 128-byte swizzle: 8-key groups 1024 bytes apart
  //   (SBO), the next 64 head dims BLOCK_N x 128 bytes on (LBO); a k16 step is 16 keys = 2048 bytes.
  unsigned char* sQ = smem + S::kQ + wg * kWgRows * 128;
  // Each descriptor is a base built once plus a byte offset (wgmma_desc_at): the offsets are
  // compile-time constants in the unrolled k-loops, the stage's a run-time multiple of the tile.
  const u64 q_base = wgmma_desc(sQ, SWIZZLE_128B, 16, 1024);
  const u64 k_base = wgmma_desc(smem + S::kK, SWIZZLE_128B, 16, 1024);
  const u64 v_base = wgmma_desc(smem + S::kV, SWIZZLE_128B, BLOCK_N * 128, 1024);
  auto q_desc = [&](int kk) { return wgmma_desc_at(q_base, (kk / 4) * kBlockM * 128 + (kk % 4) * 32); };
  auto k_desc = [&](int stage, int kk) {
    return wgmma_desc_at(k_base, stage * S::kTileBytes + (kk / 4) * BLOCK_N * 128 + (kk % 4) * 32);
  };
  auto v_desc = [&](int stage, int kk) { return wgmma_desc_at(v_base, stage * S::kTileBytes + kk * 16 * 128); };

  // ping-pong: warpgroup wg issues its GEMMs after the other has issued its own (named barrier
  // kPingPongBar + wg, 256 threads: its own 128 syncing, the other's 128 arriving)
  const int my_turn = kPingPongBar + wg, their_turn = kPingPongBar + (wg ^ 1);
  if (wg == 1) named_bar_arrive(their_turn, 2 * 128);  // consumer 0 goes first

  int stage = 0;
  u32 phase = 0, q_phase = 0;
  float o[HEADDIM / 2];   // O accumulator: o[4j + i] row g (+8 for i >= 2), dim 8j + 2tq + (i & 1)
  float s[BLOCK_N / 2];   // S accumulator, the same layout over keys
  u32 pa[kPSteps][4];     // P as the A fragments of P V, one set a k16 step
  // CAREFUL: the keys of the pending P whose rounded weight is not 0, per row of the thread
  u32 pm[2][CAREFUL ? S::kMaskWords : 1];

  // FRESH and FINALIZE (flash_fwd_step_sm90 only; the list kernel's are 0): every tile's rows are
  // written, keys or not, from a state that is not read (fresh: acc 0, m -inf, l 0), as the output
  // and lse (finalize) rather than the state
  const bool fresh = !LIST && p.fresh != 0, finalize = !LIST && p.finalize != 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    int mb, h, b, r = 0, r_end = 1;
    KeyRange<BLOCK_N> keys = first_key_range<LIST, BLOCK_N>(p, t, mb, h, b, r, r_end, cur);
    if (keys.empty() && !fresh && !finalize) continue;
    // LIST: whether a later rectangle of the group follows this one (the last frees the Q tile)
    bool more = false;
    if constexpr (LIST) more = live_after<BLOCK_N>(rects, r, r_end, mb);

    // ---- this thread's rows (relative to q_start) and their running state
    const int w0 = mb * kBlockM + wg * kWgRows + warp * 16;  // first row of this warp
    const int row[2] = {w0 + g, w0 + g + 8};
    const bool row_ok[2] = {row[0] < rect.q_len, row[1] < rect.q_len};
    float m_i[2], l_i[2];  // l_i: this thread's partial row sum (tq == 0 starts from l)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool read = row_ok[r] && !fresh;
      m_i[r] = read ? m_row0(b, h)[row[r]] : neg_inf();
      l_i[r] = (read && tq == 0) ? l_row0(b, h)[row[r]] : 0.f;
#pragma unroll
      for (int j = 0; j < HEADDIM / 8; ++j) {
        float2 a = make_float2(0.f, 0.f);
        if (read)
          a = *reinterpret_cast<const float2*>(acc_row0(b, h) + row[r] * p.acc_stride.s + 8 * j + 2 * tq);
        o[4 * j + 2 * r] = a.x;
        o[4 * j + 2 * r + 1] = a.y;
      }
    }
    // rows of this warpgroup, for the per-tile mask test
    const int wg_row0 = mb * kBlockM + wg * kWgRows;

    // ---- softmax of S (key tile j) in place: mask, new max, P = exp2(S * scale - m), row sums;
    // returns the rescale factors of O in alpha. m is in scaled units (the state's); the max is
    // taken over the raw scores (max(S) * scale = max(S * scale): rounding is monotonic) so that
    // the scale folds into one FFMA an element. Only tiles that cross a bound run the mask, in a
    // loop of their own: a test inside the element loop costs a branch region an element. A packed
    // list (params.cuh) runs it in every tile.
    auto softmax = [&](int j, float alpha[2]) {
      const int n0 = j * BLOCK_N;
      const int2* row_keys = LIST ? p.row_keys : nullptr;  // a constant-bank operand, none held
      const bool need_mask = n0 + BLOCK_N > rect.k_len ||
                             rect.k_pos + n0 + BLOCK_N - 1 > rect.q_pos + wg_row0 + rect.hi ||
                             rect.k_pos + n0 < rect.q_pos + wg_row0 + kWgRows - 1 - rect.lo ||
                             row_keys != nullptr;
      if (need_mask) {
        // row r keeps the keys first[r] .. last[r] of this tile (flash_fwd_step's bounds; packed,
        // within the row's run of keys too, loaded here: L1 hits, no registers held across tiles)
        int first[2], last[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          first[r] = rect.q_pos + row[r] - rect.lo - rect.k_pos - n0;
          last[r] = min(rect.k_len - 1, rect.q_pos + row[r] + rect.hi - rect.k_pos) - n0;
          if (row_keys != nullptr) {  // a row past q_len (another group's) sees no key
            const int2 run = row_ok[r] ? row_keys[rect.q_start + row[r]] : make_int2(0, 0);
            first[r] = max(first[r], run.x - rect.k_start - n0);
            last[r] = min(last[r], run.y - rect.k_start - 1 - n0);
          }
        }
#pragma unroll
        for (int jj = 0; jj < BLOCK_N / 8; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = 8 * jj + 2 * tq + (e & 1);
            const bool keep = key >= first[e / 2] && key <= last[e / 2];
            s[4 * jj + e] = keep ? s[4 * jj + e] : neg_inf();
          }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int jj = 0; jj < BLOCK_N / 8; ++jj) mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * r], s[4 * jj + 2 * r + 1]));
        mx = fmaxf(m_i[r], warp_max<4>(mx) * scale_log2);
        const float ref = mx == neg_inf() ? 0.f : mx;  // the finite -inf guard (flash_fwd.cu)
        alpha[r] = exp2f(m_i[r] - ref);
        m_i[r] = mx;
        float sum = 0.f;
        if (fabsf(ref) < kFusedShiftBelow) {  // scale and shift in one rounding (FFMA)
#pragma unroll
          for (int jj = 0; jj < BLOCK_N / 8; ++jj) {
            s[4 * jj + 2 * r] = exp2f(fmaf(s[4 * jj + 2 * r], scale_log2, -ref));
            s[4 * jj + 2 * r + 1] = exp2f(fmaf(s[4 * jj + 2 * r + 1], scale_log2, -ref));
            sum += s[4 * jj + 2 * r] + s[4 * jj + 2 * r + 1];
          }
        } else {  // scaled first, as ref was: the max's own P is exp2(0) (SOFTMAX SHIFT above)
#pragma unroll
          for (int jj = 0; jj < BLOCK_N / 8; ++jj) {
            s[4 * jj + 2 * r] = exp2f(__fmul_rn(s[4 * jj + 2 * r], scale_log2) - ref);
            s[4 * jj + 2 * r + 1] = exp2f(__fmul_rn(s[4 * jj + 2 * r + 1], scale_log2) - ref);
            sum += s[4 * jj + 2 * r] + s[4 * jj + 2 * r + 1];
          }
        }
        l_i[r] = l_i[r] * alpha[r] + sum;
      }
    };
    auto rescale_o = [&](const float alpha[2]) {
#pragma unroll
      for (int j = 0; j < HEADDIM / 8; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    };
    // P (in s) -> the A fragments of P V (hopper.cuh, accumulator_as_a)
    auto pack_p = [&]() {
      accumulator_as_a<T, BLOCK_N>(s, pa);
      if constexpr (CAREFUL) {  // pm from the rounded weights, then over the row's 4 threads
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int w = 0; w < S::kMaskWords; ++w) pm[r][w] = 0;
#pragma unroll
        for (int kc = 0; kc < kPSteps; ++kc)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              // keys 16kc + (8) + 2tq + e: 2tq + e < 8 never crosses a word, so the word index is
              // a compile-time constant (a run-time index would put pm in local memory)
              const int base = 16 * kc + (i >= 2 ? 8 : 0);
              if ((pa[kc][i] >> (16 * e)) & 0x7fffu) pm[i & 1][base / 32] |= 1u << ((base + 2 * tq + e) % 32);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int w = 0; w < S::kMaskWords; ++w) {
            pm[r][w] |= __shfl_xor_sync(0xffffffffu, pm[r][w], 1);
            pm[r][w] |= __shfl_xor_sync(0xffffffffu, pm[r][w], 2);
          }
      }
    };
    // CAREFUL, once P V of stage st has completed (the V values it zeroed took part as zeros):
    // each output that a non-finite V value reaches through a non-zero weight becomes NaN, as in
    // flash_fwd.cu's gemm_rs_masked (IEEE arithmetic would give +-Inf for some of them)
    auto taint = [&](int st) {
      if constexpr (CAREFUL) {
        const u32* nf = reinterpret_cast<const u32*>(smem + S::kNf + st * S::kNfBytes);
#pragma unroll
        for (int j = 0; j < HEADDIM / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = 8 * j + 2 * tq + e;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              u32 hit = 0;
#pragma unroll
              for (int w = 0; w < S::kMaskWords; ++w) hit |= pm[r][w] & nf[d * S::kMaskWords + w];
              if (hit) o[4 * j + 2 * r + e] = NAN;
            }
          }
      }
    };
    auto issue_qk = [&](int st) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) wgmma_ss<T, BLOCK_N, 0, 0>(s, q_desc(kk), k_desc(st, kk), kk > 0);
    };
    auto issue_pv = [&](int st) {
#pragma unroll
      for (int kc = 0; kc < kPSteps; ++kc) wgmma_rs<T, HEADDIM, 1>(o, pa[kc], v_desc(st, kc), true);
    };
    auto advance = [&](int& st, u32& ph) {
      if (++st == STAGES) {
        st = 0;
        ph ^= 1;
      }
    };

    if (!keys.empty()) {  // (no key: fresh or finalize writes the rows below all the same)
      // ---- prologue: S = Q K_begin^T
      mbar_wait(q_full, q_phase);
      mbar_wait(k_full + stage, phase);
      named_bar_sync(my_turn, 2 * 128);
      wgmma_fence_operand(s);
      wgmma_fence();
      issue_qk(stage);
      wgmma_commit();
      named_bar_arrive(their_turn, 2 * 128);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
      if (keys.end - keys.begin == 1 && !more) mbar_arrive(q_empty);  // the tile's last use of Q
      {
        float alpha[2];
        softmax(keys.begin, alpha);
        rescale_o(alpha);
        pack_p();
      }
      int prev = stage;          // the stage whose P V is pending, and its phase
      u32 prev_phase = phase;
      advance(stage, phase);

      // ---- steady state (LIST: on through the group's live rectangles, the pipeline unbroken)
      for (int j = keys.begin; next_key_tile<LIST>(j, keys, rects, r, r_end, mb, cur);) {
        if (LIST && j == keys.begin) {
          // a new rectangle: the row sums reduced over the row group (thread tq == 0 holds them),
          // as writing the state and reading it back between two launches would: the same bits
          more = live_after<BLOCK_N>(rects, r, r_end, mb);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float lsum = warp_sum<4>(l_i[i]);
            l_i[i] = tq == 0 ? lsum : 0.f;
          }
        }
        mbar_wait(k_full + stage, phase);
        mbar_wait(v_ready + prev, prev_phase);
        named_bar_sync(my_turn, 2 * 128);
        wgmma_fence_operand(s);
        wgmma_fence_operand(o);
        wgmma_fence_operand(pa);
        wgmma_fence();
        issue_qk(stage);
        wgmma_commit();
        issue_pv(prev);
        wgmma_commit();
        wgmma_fence_operand(pa);
        named_bar_arrive(their_turn, 2 * 128);
        wgmma_wait<1>();  // S ready; P V still in flight
        wgmma_fence_operand(s);
        if (j == keys.end - 1 && !more) mbar_arrive(q_empty);
        float alpha[2];
        softmax(j, alpha);
        wgmma_wait<0>();  // P_{j-1} V_{j-1} done: its stage is free, O may be rescaled
        wgmma_fence_operand(o);
        taint(prev);
        mbar_arrive(kv_empty + prev);
        rescale_o(alpha);
        pack_p();
        prev = stage;
        prev_phase = phase;
        advance(stage, phase);
      }

      // ---- epilogue: O += P_last V_last
      mbar_wait(v_ready + prev, prev_phase);
      named_bar_sync(my_turn, 2 * 128);
      wgmma_fence_operand(o);
      wgmma_fence_operand(pa);
      wgmma_fence();
      issue_pv(prev);
      wgmma_commit();
      wgmma_fence_operand(pa);
      named_bar_arrive(their_turn, 2 * 128);
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      taint(prev);
      mbar_arrive(kv_empty + prev);
      q_phase ^= 1;
    }

    // ---- write the state back (rows past q_len were never read and are not written)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lsum = warp_sum<4>(l_i[r]);
      if (!row_ok[r]) continue;
      if (finalize) {
        // flash_fwd_finalize's arithmetic: out = acc / l, lse = (m + log2 l) ln 2; a row that saw
        // no key (l == 0; not l > 0: a NaN the row saw stays NaN) gets out 0 and lse -inf
        const long long at = (long long)(rect.q_start + row[r]);
        T* out_row = static_cast<T*>(p.out) + b * p.out_stride.b + at * p.out_stride.s + h * p.out_stride.h;
#pragma unroll
        for (int j = 0; j < HEADDIM / 8; ++j) {
          const float x = lsum == 0.f ? 0.f : o[4 * j + 2 * r] / lsum;
          const float y = lsum == 0.f ? 0.f : o[4 * j + 2 * r + 1] / lsum;
          *reinterpret_cast<u32*>(out_row + 8 * j + 2 * tq) = pack2<T>(x, y);
        }
        if (tq == 0)
          p.lse[b * p.lse_stride.b + h * p.lse_stride.h + at] =
              lsum == 0.f ? neg_inf() : (m_i[r] + log2f(lsum)) * 0.6931471805599453f;
        continue;
      }
      if (tq == 0) {
        m_row0(b, h)[row[r]] = m_i[r];
        l_row0(b, h)[row[r]] = lsum;
      }
      float* out_row = acc_row0(b, h) + row[r] * p.acc_stride.s;
#pragma unroll
      for (int j = 0; j < HEADDIM / 8; ++j)
        *reinterpret_cast<float2*>(out_row + 8 * j + 2 * tq) = make_float2(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
    }
  }
  // balance the ping-pong: consumer 1 arrived once more on consumer 0's turn than 0 synced
  if (wg == 0) named_bar_sync(my_turn, 2 * 128);
}

}  // namespace fwd90

/* Fold attention of query rows [q_start, q_start + q_len) over key rows [k_start, k_start + k_len)
   (p.blk) into the running state (p.acc, p.m, p.l): FwdStepSm90Params (kernels/params.cuh).
   grid (min(p.n_tiles, SMs), 1, 1), block 384 threads, dynamic smem fwd90::Smem<...>::kBytes;
   p.n_tiles = ceil(q_len / 128) x H x B. Returns at once when *p.nonfinite is set (the careful
   twin of the launch pair runs instead). */
template <typename T, int HEADDIM, int BLOCK_N, int STAGES, bool CAREFUL = false>
__global__ void __launch_bounds__(fwd90::kThreads, 1)
flash_fwd_step_sm90(const __grid_constant__ FwdStepSm90Params p) {
  fwd90::fold<T, HEADDIM, BLOCK_N, STAGES, CAREFUL, false>(p);
}

/* Every rectangle of a ring step in one launch: p.rects grouped by query range (p.groups,
   p.n_groups; burstcu.ops.cuda.params.step_groups with tiles of 128 rows), q_map, k_map, v_map
   over the whole q, k, v arrays. Work item t (a group's query tile, head, batch; p.n_tiles =
   the groups' tiles x H x B) folds its group's rectangles in order, as one flash_fwd_step_sm90
   launch each would, bit for bit (p.row_keys set, a packed list: each row within its run of keys
   too, the same pairs in other tiles, equal within rounding). Launched as flash_fwd_step_sm90 (the same smem, block, grid min(p.n_tiles, SMs)) and
   with its careful twin where the list has masked pairs, a key count off the tiles (rows past
   k_len are the next rows of the arrays, not zeros) or is packed. */
template <typename T, int HEADDIM, int BLOCK_N, int STAGES, bool CAREFUL = false>
__global__ void __launch_bounds__(fwd90::kThreads, 1)
flash_fwd_steps_sm90(const __grid_constant__ FwdStepSm90Params p) {
  fwd90::fold<T, HEADDIM, BLOCK_N, STAGES, CAREFUL, true>(p);
}

#if defined(BURSTCU_NVCC_CHECK)
template __global__ void flash_fwd_step_sm90<__half, 128, 128, 2>(const FwdStepSm90Params);
template __global__ void flash_fwd_steps_sm90<__half, 128, 128, 2>(const FwdStepSm90Params);
#endif

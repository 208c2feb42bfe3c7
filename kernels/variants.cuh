// variants.cuh: the attention variants as hooks the loops call (the idea of FlexAttention's mask_mod / score_mod and
// of FlashAttention's mask.h), in the pipelined forward (flash_v2_forward_pipelined.cu) and the tensor-core backward
// (flash_v2_backward_tc.cu). The definitions, and their numpy twins, are stages/common/variants.py. A kernel
// instantiation takes one type per hook, built from its parameter struct (FwdParams or BwdParams, params.cuh):
//   Mask   which keys each query row sees; the K/V tiles a Q tile must visit (forward) and the Q tiles a K/V tile
//          must visit (backward):
//            CausalMask  keys < Nk, and with causal, keys on or left of the row's diagonal (plain attention);
//            WindowMask  keys inside a window (left, right) around the diagonal; also runs packed batches.
//   Score  what happens to S_ij before the softmax (forward), and its derivative (backward):
//            PlainScore  nothing (forward: the scale is folded into exp2's argument, FwdParams.exp2_scale;
//                        backward: exponent applies it);
//            ModScore    x = scale Q_i K_j^T (= S_ij), then softcap x -> cap tanh(x / cap), then ALiBi
//                        x -> x - slope |diag - c| (c: the key).
//   Drop   dropout on P~_ij before P~_ij V_j (forward); Z_ij on P_ij^T and dP_ij^T (backward):
//            NoDropout, PhiloxDropout (dropout.cuh).
// Plain attention's hooks do nothing at compile time: its instantiation is the plain kernel. The forward applies a
// hook to a whole fragment of S (apply); the backward, whose fragments are S^T (rows are keys), asks per score
// (visible, exponent, keep_bits and dropped). Stage 06's kernels call the same hooks (kernels/hopper_variants.cuh):
// the forward's warp-specialised loop on its S fragments (apply), the backward's on S^T one entry at a time (hidden;
// hopper_bwd_tiles.cuh applies ModScore's fields to S^T). CausalMask and PlainScore take any parameter struct with
// the fields they read, so that stage 06's plain kernels pass their own.
// Fragment layout of s (one warp, MT m-tiles of 16 rows x NC keys; lane = 4 g + t): entry e of n-tile n in m-tile m
// is row r0 + 16 m + g + 8 (e / 2), key col0 + 8 n + 2 t + (e % 2) (kernels/common.cuh).
// Indices: r (or q) is a query row and c (or kv) a key, element indices of the whole problem; i, j index tiles.
// The hooks build on kernels/attention_tiles.cuh (mask_scores, mask_window, transform_scores, visited_kv_tiles, and
// the forward's row state and epilogue), included here: a kernel that includes this header has both.
#pragma once
#include "attention_tiles.cuh"
#include "dropout.cuh"
#include "params.cuh"

// ---------------------------------------------------------------- Where a head's rows are
// Query head bh (batch b, head h) reads k/v head h / group of batch b (grouped-query attention; group = 1: its own).
// q, o, lse have ldq rows per head and k, v ldk (Nq, Nk for a whole problem; a ring block's shard and block are
// longer). A packed batch (PACKED and cu_q != null): q, o are (H, total_q, D) and k, v (H / group, total_k, D);
// grid.y runs over (sequence s, head h) and sequence s is rows cu_q[s]..cu_q[s + 1] - 1 (keys: cu_k): inside the
// block, everything is that one sequence's attention. hd: the (batch, head) of the ALiBi slope and dropout's counter.
// P: FwdParams or BwdParams.
struct HeadRows {
    long q0, kv0, hd;  // first row of this head in q, o, lse and in k, v
    int Nq, Nk;
    int s0;  // a packed batch: the sequence's first row inside its head (cu_q[s]); 0 otherwise
};
template <bool PACKED, typename P>
__device__ __forceinline__ HeadRows head_rows(const P& p, long bh, bool whole_problem) {
    const int H = p.H, group = p.group;
    const int ldq = whole_problem ? p.Nq : p.ldq, ldk = whole_problem ? p.Nk : p.ldk;
    const int bkv = (int)bh / H * (H / group) + (int)bh % H / group;  // the k/v head of query head bh
    HeadRows r{bh * ldq, (long)bkv * ldk, bh, p.Nq, p.Nk, 0};
    if constexpr (PACKED) {
        if (p.cu_q != nullptr) {
            const int s = (int)bh / H, h = (int)bh % H;
            r = HeadRows{(long)h * ldq + p.cu_q[s], (long)(h / group) * ldk + p.cu_k[s], h,
                         p.cu_q[s + 1] - p.cu_q[s], p.cu_k[s + 1] - p.cu_k[s], p.cu_q[s]};
        }
    }
    return r;
}

// ---------------------------------------------------------------- Mask hooks
// Causal masking is aligned bottom-right: query r sees key c iff c <= r + shift, shift = Nk - Nq.
struct CausalMask {
    enum : bool { packed = false };  // takes no packed batch
    template <typename P>
    using For = CausalMask;  // built from any parameter struct (its fields are copies)
    int Nk, shift, causal;

    template <typename P>  // FwdParams, BwdParams, or stage 06's parameter structs (they have causal too)
    __device__ CausalMask(const P& p, int Nq, int Nk) : Nk(Nk), shift(Nk - Nq), causal(p.causal) {}
    // The last key row r sees (Nk - 1 at most; < 0: none).
    __device__ int last_key(int r) const { return causal ? min(Nk - 1, r + shift) : Nk - 1; }
    // Stage 06's backward (S^T, keys as rows): whether row r does not see key c, and whether rows r0..r1 x keys
    // c0..c1 hold such an entry. Bitwise, not short-circuit: straight-line predicates, no branch.
    __device__ bool hidden(int r, int c) const { return (c >= Nk) | ((causal != 0) & (c > r + shift)); }
    __device__ bool part_masked(int r0, int r1, int c0, int c1) const {
        return (c1 >= Nk) | ((causal != 0) & (c1 > r0 + shift));
    }
    // The K/V tiles j_first <= j < j_end that rows row0..last_row visit (causal: none right of the last diagonal).
    template <int BR, int BC>
    __device__ int2 kv_tiles(int row0, int Nq) const {
        return make_int2(0, visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal));
    }
    // Block-uniform: tile j holds Nk's tail or keys right of the first row's diagonal.
    template <int BC>
    __device__ bool tile_masked(int j, int row0, int last_row) const {
        return (j + 1) * BC > Nk || (causal && (j + 1) * BC - 1 > row0 + shift);
    }
    // Per warp, rows r_first..r_last: keys col0..col0 + NC - 1 all hidden (skip the slice), or some hidden (mask it).
    __device__ bool slice_hidden(int col0, int NC, int r_first, int r_last) const {
        return causal && col0 > r_last + shift;
    }
    __device__ bool slice_masked(int col0, int NC, int r_first) const {
        return col0 + NC > Nk || (causal && col0 + NC - 1 > r_first + shift);
    }
    template <int MT, int NC>
    __device__ void apply(float (&s)[MT][NC / 8][4], int r0, int col0, int g, int t) const {
        mask_scores<MT, NC>(s, r0, col0, Nk, causal, shift, g, t);
    }
    // Backward: the Q tiles i_first <= i < i_end with a row that sees a key of K_j (causal: none above the
    // diagonal through K_j's first key), and whether query q sees key kv.
    template <int BR, int BC>
    __device__ int2 q_tiles(int j, int Nq) const {
        return make_int2(causal ? max(0, j * BC - shift) / BR : 0, (Nq + BR - 1) / BR);
    }
    __device__ bool visible(int q, int kv) const {  // without branches: without causal, a bound no key reaches
        return (kv < Nk) & (kv - q <= (causal ? shift : 1 << 29));
    }
};

// Key c is visible to row r iff c < Nk, c <= r + shift + right (right >= 0), c >= r + shift - left (left >= 0).
// Causal is the window (-1, 0). Only the band of K/V tiles holding a visible key is visited. P: the kernel's
// parameter struct, whose left and right are read where used (from the kernel's parameter space).
template <typename P>
struct WindowMaskOf {
    enum : bool { packed = true };  // takes packed batches (cu_q, cu_k)
    const P& p;
    int Nk, shift;

    __device__ WindowMaskOf(const P& p, int Nq, int Nk) : p(p), Nk(Nk), shift(Nk - Nq) {}
    __device__ int last_key(int r) const { return p.right < 0 ? Nk - 1 : min(Nk - 1, r + shift + p.right); }
    // Rows from Nq = Nk - shift on see no key: stage 06's backward reads a packed sequence's L_i past its end.
    __device__ bool hidden(int r, int c) const {
        const int left = p.left, right = p.right;
        return (c >= Nk) | (r >= Nk - shift) | ((right >= 0) & (c > r + shift + right)) |
               ((left >= 0) & (c < r + shift - left));
    }
    __device__ bool part_masked(int r0, int r1, int c0, int c1) const {
        const int left = p.left, right = p.right;
        return (c1 >= Nk) | (r1 >= Nk - shift) | ((right >= 0) & (c1 > r0 + shift + right)) |
               ((left >= 0) & (c0 < r1 + shift - left));
    }
    template <int BR, int BC>
    __device__ int2 kv_tiles(int row0, int Nq) const {
        const int left = p.left, right = p.right;
        const int last_row = min(row0 + BR, Nq) - 1;
        const int last_key = right < 0 ? Nk - 1 : min(Nk - 1, last_row + shift + right);
        const int first_key = left < 0 ? 0 : max(0, row0 + shift - left);
        const int j_first = first_key / BC;
        return make_int2(j_first, last_key < 0 || first_key > last_key ? j_first
                                                                       : min((Nk + BC - 1) / BC, last_key / BC + 1));
    }
    template <int BC>
    __device__ bool tile_masked(int j, int row0, int last_row) const {
        const int left = p.left, right = p.right;
        return (j + 1) * BC > Nk || (right >= 0 && (j + 1) * BC - 1 > row0 + shift + right) ||
               (left >= 0 && j * BC < last_row + shift - left);
    }
    __device__ bool slice_hidden(int col0, int NC, int r_first, int r_last) const {
        const int left = p.left, right = p.right;
        return (right >= 0 && col0 > r_last + shift + right) || (left >= 0 && col0 + NC - 1 < r_first + shift - left);
    }
    __device__ bool slice_masked(int, int, int) const { return true; }
    template <int MT, int NC>
    __device__ void apply(float (&s)[MT][NC / 8][4], int r0, int col0, int g, int t) const {
        mask_window<MT, NC>(s, r0, col0, Nk, p.left, p.right, shift, g, t);
    }
    // Backward: the Q tiles from the first row whose window reaches K_j's first key to the last row whose window
    // reaches its last, and whether query q sees key kv.
    template <int BR, int BC>
    __device__ int2 q_tiles(int j, int Nq) const {
        const int left = p.left, right = p.right;
        const int first = right < 0 ? 0 : max(0, j * BC - shift - right);
        const int last = left < 0 ? Nq - 1 : min(Nq - 1, min(Nk, j * BC + BC) - 1 - shift + left);
        return make_int2(first / BR, first <= last ? last / BR + 1 : first / BR);
    }
    __device__ bool visible(int q, int kv) const {  // & rather than &&: no branches
        const int d = kv - q - shift;  // how far right of the row's diagonal the key is
        return (kv < Nk) & ((p.right < 0) | (d <= p.right)) & ((p.left < 0) | (d >= -p.left));
    }
};
// The window hook as kernels name it; For<BwdParams>: the same hook built from the backward's struct.
struct WindowMask : WindowMaskOf<FwdParams> {
    using WindowMaskOf<FwdParams>::WindowMaskOf;
    template <typename P>
    using For = WindowMaskOf<P>;
};

// ---------------------------------------------------------------- Score hooks
// A parameter struct's softmax scale, or NaN for one without (stage 06's forward structs carry only exp2's factor,
// and never call exponent): a backward built on such a struct would give NaN everywhere, not a quietly wrong answer.
template <typename P>
__device__ __forceinline__ auto scale_of(const P& p, int) -> decltype(float(p.scale)) { return p.scale; }
template <typename P>
__device__ __forceinline__ float scale_of(const P&, long) { return __int_as_float(0x7fc00000); }

struct PlainScore {
    float scale;  // the backward's (the forward folds it into exp2_scale)

    template <typename P>  // any parameter struct: its scale where it has one (stage 06's forward folds it away)
    __device__ PlainScore(const P& p, long, int) : scale(scale_of(p, 0)) {}
    template <int MT, int NC>
    __device__ void apply(float (&)[MT][NC / 8][4], int, int, int, int) const {}
    // Backward, Alg.2 L11: the exponent of P_ij = exp(scale S_ij - L_i) for s = S_ij of query q, key kv: one FMA (one
    // rounding, of a number near 0); grad = d x_ij / d (scale S_ij) = 1, which dS_ij takes (nothing at compile time).
    __device__ float exponent(float s, float L, int, int, float& grad) const {
        grad = 1.f;
        return fmaf(s, scale, -L);
    }
};

// The scores in natural units (FwdParams.exp2_scale is then log2(e)). hd: the (batch, head) of the ALiBi slope;
// shift: Nk - Nq, moved by a_off for a ring block (ALiBi's diagonal is the whole problem's).
struct ModScore {
    float scale, softcap, slope;
    int diag_shift;

    template <typename P>
    __device__ ModScore(const P& p, long hd, int shift)
        : scale(p.scale), softcap(p.softcap), slope(p.slopes != nullptr ? p.slopes[hd] : 0.f),
          diag_shift(shift + p.a_off) {}
    template <int MT, int NC>
    __device__ void apply(float (&s)[MT][NC / 8][4], int r0, int col0, int g, int t) const {
        if (softcap > 0.f)  // branches once per slice, not once per score (see transform_scores)
            apply_with<MT, NC, true>(s, r0, col0, g, t);
        else
            apply_with<MT, NC, false>(s, r0, col0, g, t);
    }
    template <int MT, int NC, bool CAP>
    __device__ void apply_with(float (&s)[MT][NC / 8][4], int r0, int col0, int g, int t) const {
        if (slope != 0.f)
            transform_scores<MT, NC, CAP, true>(s, r0, col0, diag_shift, scale, softcap, slope, g, t);
        else
            transform_scores<MT, NC, CAP, false>(s, r0, col0, diag_shift, scale, softcap, slope, g, t);
    }
    // Backward, Alg.2 L11: x_ij - L_i for P_ij = exp(x_ij - L_i), x = c tanh(scale S_ij / c) - slope |q + shift - kv|,
    // and grad = d x_ij / d (scale S_ij) = 1 - tanh^2 (softcap; 1 without), by which dS_ij is multiplied. tanh from
    // exp2 (common.cuh), within ~2e-7 of the forward's.
    __device__ float exponent(float s, float L, int q, int kv, float& grad) const {
        float x = s * scale;
        grad = 1.f;
        if (softcap > 0.f) {
            const float th = tanh_from_exp2(x * (1.f / softcap) * (2.f * LOG2E_F));
            x = softcap * th;
            grad = 1.f - th * th;
        }
        x -= slope * (float)abs(q + diag_shift - kv);
        return x - L;
    }
};

// ---------------------------------------------------------------- Dropout hooks
struct NoDropout {
    static constexpr bool draws = false;  // no random bits per score
    template <typename P>
    __device__ NoDropout(const P&, long) {}
    __device__ float rp() const { return 1.f; }
    template <int MT, int NC>
    __device__ void apply(float (&)[MT][NC / 8][4], int, int, int, int) const {}
    __device__ u32 keep_bits(int, int) const { return 0u; }
    __device__ float dropped(u32, int, int, float p, float&) const { return p; }
};

// P~_ij Z_ij: rows r0 + 16 m + g (+8), keys col0 + 16 kk + 2t + e (+8); the four draws of one Philox call are exactly
// entries e and 2 + e of n-tiles 2kk and 2kk + 1. l_i (and so the lse) keeps every P~_ij; O_i is scaled by rp().
struct PhiloxDropout {
    static constexpr bool draws = true;  // random bits per score: a Philox call per 4 scores
    Dropout drop;
    long hd;  // the (batch, head) of the draws' counter

    template <typename P>
    __device__ PhiloxDropout(const P& p, long hd)
        : drop{p.keep, p.seed_lo, p.seed_hi, p.rp, p.q_off, p.k_off}, hd(hd) {}
    __device__ float rp() const { return drop.rp; }
    template <int MT, int NC>
    __device__ void apply(float (&s)[MT][NC / 8][4], int r0, int col0, int g, int t) const {
        if (drop.keep == 0u) return;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int kk = 0; kk < NC / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint4 u = dropout_draws(drop, r0 + 16 * m + g, col0 + 16 * kk + 2 * t + e, hd);
                    if (u.x >= drop.keep) s[m][2 * kk][e] = 0.f;          // (r, c)
                    if (u.y >= drop.keep) s[m][2 * kk + 1][e] = 0.f;      // (r, c + 8)
                    if (u.z >= drop.keep) s[m][2 * kk][2 + e] = 0.f;      // (r + 8, c)
                    if (u.w >= drop.keep) s[m][2 * kk + 1][2 + e] = 0.f;  // (r + 8, c + 8)
                }
    }
    // Backward (S^T: rows are keys). Z_ij of queries q + x (x = 0, 1) and q + 8 + x x keys kv, kv + 8 as eight bits,
    // one register instead of eight draws: bit 2 o + x is output o of the Philox call at (q + x, kv), in
    // dropout.cuh's order (q, kv), (q, kv + 8), (q + 8, kv), (q + 8, kv + 8).
    __device__ u32 keep_bits(int q, int kv) const {
        u32 z = 0u;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const uint4 u = dropout_draws(drop, q + x, kv, hd);
            z |= (u32)(u.x < drop.keep) << x | (u32)(u.y < drop.keep) << (2 + x) | (u32)(u.z < drop.keep) << (4 + x) |
                 (u32)(u.w < drop.keep) << (6 + x);
        }
        return z;
    }
    // The gradient through P~ = P Z / (1 - p): returns P_ij Z_ij (dV_j's operand; rp at the end) and makes dp
    // Z_ij dP_ij / (1 - p), for the entry (o, x) of keep_bits.
    __device__ float dropped(u32 bits, int o, int x, float p, float& dp) const {
        const bool kept = (bits >> (2 * o + x)) & 1u;
        dp = kept ? dp * drop.rp : 0.f;
        return kept ? p : 0.f;
    }
};

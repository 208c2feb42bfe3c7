// params.cuh: the one argument of the FlashAttention-2 kernels (as FlashAttention's Flash_fwd_params and
// Flash_bwd_params): this header holds both structs, FwdParams for the forward and BwdParams for the backward.
// Every forward version (fp32, tc, pipelined, fp32x3) takes `const __grid_constant__ FwdParams p`, every backward
// kernel (preprocess, fp32, fp32x3, tc, the deterministic dQ pass) `const __grid_constant__ BwdParams p`, and reads
// the fields it needs. stages/common/params.py mirrors both structs field by field; a CI test compiles a check of
// every offset, so the two sides cannot drift apart. The fields the variants' hooks read (kernels/variants.cuh:
// causal, left, right, scale, softcap, slopes, a_off, the dropout's) have one name in both structs.
#pragma once

struct FwdParams {
    // Arrays, row-major: q (B, H, Nq, D); k, v (B, H / group, Nk, D); o (B, H, Nq, D) in the version's output
    // type; lse (B, H, Nq) float32. slopes: ALiBi, one float per (batch, head), or null. cu_q, cu_k: a packed batch's
    // sequence bounds (sequences + 1 ints each), or null.
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    const float* slopes;
    const int* cu_q;
    const int* cu_k;
    int Nq, Nk;        // query rows and key rows of one head
    int ldq, ldk;      // rows per head of q, o, lse and of k, v: Nq, Nk, or a ring block's larger shard and block
    float scale;       // softmax scale (1 / sqrt(d) by default)
    float exp2_scale;  // what the loop multiplies a score by before exp2 (base-2 softmax: exp(x) = exp2(x log2 e)):
                       // scale log2(e) for raw scores Q_i K_j^T; log2(e) for scores a Score hook has already
                       // scaled (kernels/variants.cuh's ModScore: softcap and ALiBi act in natural units)
    int causal;        // 1: query r sees key c iff c <= r + Nk - Nq (bottom-right)
    int head_group;    // causal block order: heads per group (longest Q tiles first inside a group)
    int H, group;      // query heads; query heads per k/v head (grouped-query attention; 1 for plain)
    int left, right;   // window around the diagonal, -1 unbounded (causal is (-1, 0))
    float softcap;     // scores x -> softcap tanh(x / softcap); 0: off
    int a_off;         // ALiBi: where this block's diagonal sits in the whole problem (0 for a whole problem)
    int q_off, k_off;  // dropout: the global indices of this block's query row 0 and key 0
    unsigned int keep;                  // dropout: keep P_ij when the 32-bit draw u < keep; 0: no dropout
    float rp;                           // dropout: 1 / (1 - p)
    unsigned int seed_lo, seed_hi;      // dropout: the 64-bit Philox key
};

struct BwdParams {
    // Arrays, the preprocess's first (it reads o, dO, lse, writes D_i, L_i and zeroes dQ_accum and done), then the
    // main kernels'. Row-major: q, o, dO (B, H, ldq, d) rows 0..Nq-1; k, v (B, H / group, ldk, d); lse (B, H, ldq)
    // float32, natural log; D_i, L_i (B H, Nq_pad) float32: D_i = rowsum(dO_i * O_i) and L_i (+inf for a fully masked
    // row and past Nq, so P_ij = 0 there); dQ_accum (B, H, ldq, d) float32, the atomic dQ's sum (it receives
    // scale dS_ij K_j, so it holds dQ); done: the tc kernel's block counters, one per row of heads of its grid, or
    // null (then dQ stays in dQ_accum for bwd_convert_dq); dQ like q, dK and dV like k, v, in the gradients' type
    // (float dK, dV are added to, not written: a kv group's query heads, or a ring block). slopes, cu_q, cu_k: as
    // in FwdParams. A packed batch: q, o, dO, dQ (H, total_q, d), k, v, dK, dV (H / group, total_k, d), with Nq, Nk
    // the totals and sequence s rows cu_q[s]..cu_q[s + 1] - 1 (keys: cu_k).
    const void* o;
    const void* dO;
    const float* lse;
    float* D_i;
    float* L_i;
    float* dQ_accum;
    int* done;
    const void* q;
    const void* k;
    const void* v;
    void* dQ;
    void* dK;
    void* dV;
    const float* slopes;
    const int* cu_q;
    const int* cu_k;
    int Nq, Nk;        // query rows and key rows of one head
    int ldq, ldk;      // rows per head of q, o, dO, lse, dQ, dQ_accum and of k, v, dK, dV (FwdParams' ldq, ldk)
    int Nq_pad;        // rows per head of D_i, L_i: Nq rounded up to a multiple of every Br (tile loads stay inside)
    int head_dim;      // d, for the preprocess (the other kernels have it as a template parameter)
    float scale;       // softmax scale (1 / sqrt(d) by default)
    int causal;        // 1: query r sees key c iff c <= r + Nk - Nq (bottom-right)
    int j_fast;        // tc grid: 1, (K/V tiles, B H), the K/V tile index fastest; 0, (B H, K/V tiles)
    int H, group;      // query heads; query heads per k/v head (grouped-query attention; 1 for plain)
    int left, right;   // window around the diagonal, -1 unbounded (causal is (-1, 0))
    float softcap;     // scores x -> softcap tanh(x / softcap); 0: off
    int a_off;         // ALiBi: where this block's diagonal sits in the whole problem (0 for a whole problem)
    int q_off, k_off;  // dropout: the global indices of this block's query row 0 and key 0
    unsigned int keep;                  // dropout: keep P_ij when the 32-bit draw u < keep; 0: no dropout
    float rp;                           // dropout: 1 / (1 - p)
    unsigned int seed_lo, seed_hi;      // dropout: the 64-bit Philox key
    int zero_dq;       // preprocess: 1, also zero dQ_accum's rows 0..Nq-1 and the first n_done counters
    int n_done;        // preprocess: how many block counters to zero
};

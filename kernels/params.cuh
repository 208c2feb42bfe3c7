// params.cuh: the one argument of the FlashAttention-2 forward kernels (as FlashAttention's Flash_fwd_params).
// Every forward version (fp32, tc, pipelined, fp32x3) takes `const __grid_constant__ FwdParams p` and reads the
// fields it needs. stages/common/params.py mirrors this struct field by field; a CI test compiles a static_assert of
// every offset, so the two cannot drift apart.
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

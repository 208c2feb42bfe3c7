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
    float scale_log2;  // scale * log2(e): exp(scale s - m) = exp2(s scale_log2 - m'); log2(e) when a score hook
                       // has already applied the scale (scores in natural units)
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

// The one argument of the FlashAttention-2 backward kernels (FlashAttention's Flash_bwd_params): the preprocess, the
// main kernels of versions fp32 and tc, the deterministic dQ passes and the dQ conversion each read the fields they
// need. Arrays: q, k, v, o, dO, dQ as forward's (dK, dV like k); lse (B, H, Nq) float32; L, Dvec: L_i (times log2 e
// for the exp2 kernels) and D_i = rowsum(dO_i * O_i) per row, Nq_pad rows per head; dq_acc: the float32 dQ
// accumulator; done: per-head block counters (the last block of a head converts dQ), or null.
struct BwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;
    float* L;
    float* Dvec;
    float* dq_acc;
    void* dk;
    void* dv;
    void* dq;
    int* done;
    const float* slopes;
    const int* cu_q;
    const int* cu_k;
    long long n;       // dQ conversion: elements of dq_acc
    int Nq, Nk;        // query rows and key rows of one head
    int ldq, ldk;      // rows per head of q, o, dO, dQ and of k, v, dK, dV (a ring block's arrays are longer)
    int Nq_pad;        // rows per head of L, Dvec (Nq rounded up)
    int head_dim;      // the preprocess's d
    float scale;       // softmax scale
    float lse_mult;    // the preprocess: L = lse * lse_mult
    int causal;
    int j_fast;        // grid order of the tc kernel: 1 (Tc, B*H), 0 (B*H, Tc)
    int zero_dq;       // the preprocess zeroes dq_acc (and the ndone counters)
    int ndone;
    int H, group;      // query heads; query heads per k/v head
    int left, right;   // window around the diagonal, -1 unbounded
    float softcap;
    int a_off, q_off, k_off;            // where a ring block sits in the whole problem (ALiBi, dropout)
    unsigned int keep;                  // dropout: keep P_ij when the 32-bit draw u < keep; 0: no dropout
    float rp;                           // dropout: 1 / (1 - p)
    unsigned int seed_lo, seed_hi;      // dropout: the 64-bit Philox key
};

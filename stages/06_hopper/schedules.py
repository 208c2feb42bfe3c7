"""Hopper's schedules simulated step by step: the producer/consumer pipeline on mbarriers (phase bits), and the
ping-pong of two consumer warpgroups on the tensor cores (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3).

The pipeline. A producer warp issues the copy engine's loads of K_j, V_j into one of S shared-memory stages and goes
on; consumers compute on a stage once it is full and hand it back once they are done with it. Two mbarriers per stage
say so: full[s] completes a phase when tile j's bytes have landed, empty[s] when the consumers have released it. An
mbarrier keeps no count of phases a waiter could compare, only the parity of its current phase:
try_wait.parity(p) passes once the phase of parity p has completed (the barrier has moved to parity 1 - p). Stage s
holds tiles s, s + S, s + 2S, ...: tile j's use of stage s is round n = j // S, so the consumer waits full[s] with
parity n & 1 and the producer waits empty[s] with parity (n & 1) ^ 1 (which passes at once in round 0: the stages
start empty). One bit is enough because neither side can get two rounds ahead of the other.

The time of one tile is then max(load, compute) once S >= 2: the next tile's load hides under this tile's compute.

Ping-pong. A consumer warpgroup's tile is GEMM0 (S = Q K_j^T), softmax, GEMM1 (O += P V_j). The softmax runs on the
FMA and special-function units while the tensor cores idle; with two warpgroups, each on its own rows of Q, a pair of
named barriers orders them so that one's GEMMs run while the other's softmax does. Within one warpgroup, GEMM0 of
tile j may also be issued together with GEMM1 of tile j - 1 (wgmma is asynchronous), so that the softmax of S_j runs
while O += P_{j-1} V_{j-1} is on the tensor cores, at the price of registers for S_j, P_{j-1} and O at once.
"""
from dataclasses import dataclass, field


class MBarrier:
    """An mbarrier: completes a phase when `expected` arrivals have come; waiters test the parity of a phase."""

    def __init__(self, expected=1):
        self.expected, self.arrived, self.phase = expected, 0, 0  # phase: how many phases have completed

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.expected:
            self.arrived, self.phase = 0, self.phase + 1

    def try_wait_parity(self, parity):
        """True once the phase of this parity has completed: the current phase has the other parity."""
        return (self.phase & 1) != parity


class RaceError(AssertionError):
    """The protocol let a consumer read a stage that does not hold its tile, or a load overwrite a stage in use."""


@dataclass
class PipelineRun:
    ticks: int                                     # time until the last tile was consumed
    loads: list = field(default_factory=list)      # (tile, stage, start, end) of each copy
    computes: list = field(default_factory=list)   # (tile, stage, start, end) of each consumer step


def simulate_pipeline(n_tiles, stages, t_load, t_compute, *, consumer_parity=None, producer_parity=None,
                      producer_waits=True):
    """Run the producer/consumer protocol tick by tick. One copy at a time (the loads share the memory bandwidth),
    one consumer. Raises RaceError when a consumer starts on a stage whose content is not its tile, or a copy lands
    in a stage a consumer is reading; raises RuntimeError when neither side can move (deadlock).

    consumer_parity(round), producer_parity(round) and producer_waits=False exist to show what breaks: the
    protocol's parities are round & 1 (consumer, on full) and (round & 1) ^ 1 (producer, on empty)."""
    if n_tiles < 1 or stages < 1 or t_load < 1 or t_compute < 1:
        raise ValueError("n_tiles, stages, t_load and t_compute must be positive")
    parity = consumer_parity or (lambda n: n & 1)
    p_parity = producer_parity or (lambda n: (n & 1) ^ 1)
    full = [MBarrier() for _ in range(stages)]
    empty = [MBarrier() for _ in range(stages)]
    holds = [None] * stages         # the tile whose bytes a stage holds (None: nothing yet)
    reading = [False] * stages      # a consumer is computing on the stage
    run = PipelineRun(0)
    p_next, p_busy_until, p_tile = 0, 0, None    # producer: next tile to load, the copy in flight
    c_next, c_busy_until, c_tile = 0, 0, None    # consumer
    t = 0
    while c_next < n_tiles or c_tile is not None:
        moved = False
        if p_tile is not None and t >= p_busy_until:  # the copy landed: its bytes, then the barrier's transaction
            s = p_tile % stages
            if reading[s]:
                raise RaceError(f"t={t}: tile {p_tile}'s copy landed in stage {s} while tile {holds[s]} was read")
            holds[s] = p_tile
            full[s].arrive()
            p_tile, moved = None, True
        if c_tile is not None and t >= c_busy_until:  # the consumer is done with its stage
            s = c_tile % stages
            reading[s] = False
            empty[s].arrive()
            c_tile, moved = None, True
        if p_tile is None and p_next < n_tiles:
            s, n = p_next % stages, p_next // stages
            if not producer_waits or empty[s].try_wait_parity(p_parity(n)):
                p_tile, p_busy_until = p_next, t + t_load
                run.loads.append((p_next, s, t, p_busy_until))
                p_next, moved = p_next + 1, True
        if c_tile is None and c_next < n_tiles:
            s, n = c_next % stages, c_next // stages
            if full[s].try_wait_parity(parity(n)):
                if holds[s] != c_next:
                    raise RaceError(f"t={t}: the consumer started tile {c_next} on stage {s}, which holds "
                                    f"{'nothing' if holds[s] is None else f'tile {holds[s]}'}")
                reading[s] = True
                c_tile, c_busy_until = c_next, t + t_compute
                run.computes.append((c_next, s, t, c_busy_until))
                c_next, moved = c_next + 1, True
        if moved:
            continue  # another action may be possible at the same tick
        if p_tile is None and c_tile is None:
            raise RuntimeError(f"t={t}: deadlock: the producer waits at tile {p_next}, the consumer at {c_next}")
        t = min(x for x in (p_busy_until if p_tile is not None else None,
                            c_busy_until if c_tile is not None else None) if x is not None)
    run.ticks = t
    return run


# ---------------------------------------------------------------- ping-pong
def tile_times(D, *, gemm_rate=989.0, sfu_rate=3.9, other_per_exp=0.0):
    """(GEMM time, softmax time) of one Br x Bc tile in units where GEMM0 + GEMM1 of one score take 4 D / gemm_rate:
    each score needs 4 D matmul flops (2 D for Q K^T, 2 D for P V) and one exponential. The rates are the H100 SXM5's
    dense 16-bit matmul and special-function throughputs in TFLOP/s that the FlashAttention-3 paper gives (989 and
    3.9); other_per_exp adds the softmax's other work (max, scale, sum, conversions) per exponential, in exp units.
    Returns per-score times: (one GEMM, softmax)."""
    return 2 * D / gemm_rate, (1 + other_per_exp) / sfu_rate


def schedule_warpgroups(n_tiles, t_gemm, t_softmax, policy="pingpong"):
    """The timeline of the consumer warpgroups over n_tiles K/V tiles; each tile is GEMM0 (S = Q K_j^T, t_gemm),
    softmax (t_softmax, on the warpgroup's own FMA and special-function units) and GEMM1 (O += P V_j, t_gemm). The
    tensor cores run t_gemm worth of one warpgroup's GEMM at a time. Policies:
      "one"       one warpgroup, in order: the tensor cores idle during every softmax;
      "overlap"   one warpgroup that issues GEMM0 of tile j together with GEMM1 of tile j - 1 and waits only for the
                  first (FA3's intra-warpgroup overlap, Alg. 2; the ping-pong kernel's next_tile): the softmax of
                  tile j runs while GEMM1 of tile j - 1 does, and tile j + 1's GEMMs are issued once both are done;
      "together"  two warpgroups with nothing to order them: the warp schedulers interleave them, so their GEMMs
                  share the tensor cores (each finishing after 2 t_gemm) and their softmaxes fall together;
      "pingpong"  two warpgroups whose named barriers hand the tensor cores over: warpgroup 0's GEMM1 of tile j and
                  GEMM0 of tile j + 1 run while warpgroup 1 computes its softmax of tile j, and the other way round.
    Returns (intervals, makespan, tensor-core busy fraction); intervals: (unit, label, start, end), unit "tc",
    "wg0" or "wg1"."""
    g, s = float(t_gemm), float(t_softmax)
    if n_tiles < 1 or g <= 0 or s < 0:
        raise ValueError("n_tiles >= 1, t_gemm > 0, t_softmax >= 0")
    iv = []
    if policy == "one":
        t = 0.0
        for j in range(n_tiles):
            iv += [("tc", f"G0 {j}", t, t + g), ("wg0", f"softmax {j}", t + g, t + g + s),
                   ("tc", f"G1 {j}", t + g + s, t + 2 * g + s)]
            t += 2 * g + s
    elif policy == "overlap":
        iv += [("tc", "G0 0", 0.0, g), ("wg0", "softmax 0", g, g + s)]  # tile 0: nothing to overlap yet
        tc, sm_end = g, g + s
        for j in range(1, n_tiles + 1):
            start = max(tc, sm_end)  # the softmax of tile j - 1 and GEMM1 of tile j - 2 are done
            if j < n_tiles:  # GEMM0 of tile j, then GEMM1 of tile j - 1; the softmax of tile j under the second
                iv += [("tc", f"G0 {j}", start, start + g), ("tc", f"G1 {j - 1}", start + g, start + 2 * g),
                       ("wg0", f"softmax {j}", start + g, start + g + s)]
                tc, sm_end = start + 2 * g, start + g + s
            else:  # GEMM1 of the last tile
                iv.append(("tc", f"G1 {j - 1}", start, start + g))
    elif policy == "together":
        t = 0.0
        for j in range(n_tiles):
            iv += [("tc", f"G0 {j} (both)", t, t + 2 * g), ("wg0", f"softmax {j}", t + 2 * g, t + 2 * g + s),
                   ("wg1", f"softmax {j}", t + 2 * g, t + 2 * g + s),
                   ("tc", f"G1 {j} (both)", t + 2 * g + s, t + 4 * g + s)]
            t += 4 * g + s
    elif policy == "pingpong":
        tc = 0.0
        sm_end = [0.0, 0.0]
        for w in (0, 1):  # both GEMM0s of tile 0
            iv.append(("tc", f"G0 0 wg{w}", tc, tc + g))
            tc += g
            iv.append((f"wg{w}", "softmax 0", tc, tc + s))
            sm_end[w] = tc + s
        for j in range(n_tiles):
            for w in (0, 1):  # warpgroup w's turn: GEMM1 of tile j, then GEMM0 of tile j + 1
                start = max(tc, sm_end[w])
                iv.append(("tc", f"G1 {j} wg{w}", start, start + g))
                tc = start + g
                if j + 1 < n_tiles:
                    iv.append(("tc", f"G0 {j + 1} wg{w}", tc, tc + g))
                    tc += g
                    iv.append((f"wg{w}", f"softmax {j + 1}", tc, tc + s))
                    sm_end[w] = tc + s
    else:
        raise ValueError(f"policy {policy!r}: choose one, overlap, together or pingpong")
    makespan = max(e for _, _, _, e in iv)
    busy = sum(e - b for u, _, b, e in iv if u == "tc")
    tc = sorted((b, e) for u, _, b, e in iv if u == "tc")
    if any(b < prev_e - 1e-9 for (_, prev_e), (b, _) in zip(tc, tc[1:])):
        raise AssertionError("two GEMMs on the tensor cores at once")
    return iv, makespan, busy / makespan


# ---------------------------------------------------------------- the variants' work items and K/V band
# The arithmetic of kernels/hopper_variants.cuh (VariantScheduler) and of variants.cuh's WindowMask, in Python, so that
# what the forward skips is checked on the CPU (tests/test_06_hopper_cpu.py). A window is (left, right), -1 unbounded;
# causal is (-1, 0); shift = Nk - Nq (bottom-right alignment).
def variant_items(Nq, Nk, left, right, bc, n_blocks=None):
    """[(rank, row0, j0, n_tiles)]: the work items of one head (or one packed sequence) as the VariantScheduler gives
    them, rank = blockIdx.x over n_blocks blocks (the longest sequence's Q tiles of 128 rows; default this one's):
    the Q tile's first row (heaviest first without a left bound under a right one, as causal) and the K/V tiles of bc
    keys j0 .. j0 + n_tiles - 1 that hold a key one of its rows sees."""
    n_rows = -(-Nq // 128)
    out = []
    for rank in range(n_rows if n_blocks is None else n_blocks):
        heaviest_first = right >= 0 and left < 0 and rank < n_rows
        row0 = 128 * (n_rows - 1 - rank if heaviest_first else rank)
        j0 = j1 = 0
        if row0 < Nq:  # WindowMask.kv_tiles<128, bc>(row0, Nq)
            shift, last_row = Nk - Nq, min(row0 + 128, Nq) - 1
            last_key = Nk - 1 if right < 0 else min(Nk - 1, last_row + shift + right)
            first_key = 0 if left < 0 else max(0, row0 + shift - left)
            j0 = first_key // bc
            j1 = j0 if last_key < 0 or first_key > last_key else min(-(-Nk // bc), last_key // bc + 1)
        out.append((rank, row0, j0, j1 - j0))
    return out


def part_masked(r0, r1, c0, c1, Nq, Nk, left, right):
    """WindowMask::part_masked: whether rows r0..r1 x keys c0..c1 may hold a (row, key) the row does not see (True
    where in doubt: the mask is then applied; False only where every entry is seen)."""
    shift = Nk - Nq
    return (c1 >= Nk or r1 >= Nq or (right >= 0 and c1 > r0 + shift + right)
            or (left >= 0 and c0 < r1 + shift - left))


def last_tile_width(first, Nq, Nk, right, j_last, bc):
    """The keys of an item's last K/V tile j_last that a consumer warpgroup's GEMMs take (hopper_pingpong.cuh at
    D = 128: a last tile whose 64-key blocks past the rows' last seen key hold nothing is computed that narrow): 64,
    128 or bc. first: the warpgroup's first row."""
    last_row = min(first + 63, Nq - 1)
    last_key = Nk - 1 if right < 0 else min(Nk - 1, last_row + Nk - Nq + right)  # WindowMask::last_key
    last_keys = max(1, last_key - bc * j_last + 1)
    if last_keys > bc - 64:
        return bc
    return 64 if last_keys <= 64 else bc - 64

"""Hopper's shared-memory layouts as index arithmetic: the swizzle the copy engine (TMA) writes and the matrix
descriptor through which a warpgroup's asynchronous MMA (wgmma) reads the same bytes back.

Why a swizzle. Shared memory has 32 banks of 4 bytes: a 128-byte line touches each bank once. An MMA operand is read
in 8-row x 16-byte "core matrices"; stored row after row with 128-byte rows, the 8 rows of one core matrix sit at the
same offset inside 8 different lines, all in the same 4 banks: an 8-way conflict. The swizzle moves 16-byte chunk c of
row r to chunk c XOR (r mod 8): the 8 rows' chunks land in 8 different bank groups and are read in one pass. The copy
engine applies it while writing (CU_TENSOR_MAP_SWIZZLE_128B), and wgmma undoes it while reading (the descriptor's
swizzle mode), so no thread ever computes it. Stage 02's kernels pad each row by 16 bytes instead; TMA cannot pad.

The swizzle acts on byte addresses (CUTLASS's Swizzle<B, 4, 3>): bits 4 .. 3 + B (the 16-byte chunk) are XORed with
bits 7 .. 6 + B (the 128-byte line), B = 3, 2, 1 for the 128, 64 and 32-byte modes. It repeats every 8 lines
(1024 bytes in the 128-byte mode), so a tile must start at a multiple of that for the pattern the writer used and the
pattern the reader assumes to agree.

A tile of rows x D elements whose rows are longer than the swizzle span (D = 128 bf16 values is 256 bytes) is stored
as panels: columns 64 p .. 64 p + 63 (128 bytes) of every row form panel p, one TMA box each, panel after panel.
"""
import numpy as np

SPAN = {128: 3, 64: 2, 32: 1}  # swizzle mode (bytes) -> B, the number of chunk bits it XORs
CHUNK = 16  # bytes: one row of a core matrix (8 bf16 / fp16 values)
CORE_ROWS = 8  # rows of a core matrix
BANK_BYTES = 4
BANKS = 32


def swizzle(addr, mode=128):
    """The byte address where the swizzle of `mode` bytes (128, 64, 32; 0: none) puts logical address addr (ints or
    an integer array): chunk bits 4 .. 3 + B XOR line bits 7 .. 6 + B."""
    if mode == 0:
        return addr
    if mode not in SPAN:
        raise ValueError(f"swizzle mode {mode!r}: choose 128, 64, 32 or 0 (none)")
    mask = (1 << SPAN[mode]) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def tile_offset(r, c, *, rows, cols, elem_bytes=2, mode=128):
    """Byte offset, inside the tile, of element (r, c) of a rows x cols tile stored in panels of `mode` bytes with
    the swizzle of `mode` (the layout the copy engine writes for a box of `mode` bytes per row)."""
    if mode not in SPAN:
        raise ValueError(f"swizzle mode {mode!r}: choose 128, 64 or 32")
    if cols * elem_bytes % mode:
        raise ValueError(f"a row of {cols} x {elem_bytes} bytes is not a whole number of {mode}-byte panels")
    per_panel = mode // elem_bytes  # elements of one row in one panel
    panel, within = np.divmod(c, per_panel)
    return swizzle(panel * rows * mode + r * mode + within * elem_bytes, mode)


def store_tile(x, *, mode=128):
    """The bytes of shared memory after the copy engine wrote tile x (rows x cols, a 2- or 4-byte dtype) with the
    swizzle of `mode`: a uint8 array of x.nbytes."""
    x = np.ascontiguousarray(x)
    rows, cols = x.shape
    eb = x.dtype.itemsize
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = tile_offset(r, c, rows=rows, cols=cols, elem_bytes=eb, mode=mode)
    smem = np.zeros(x.nbytes, np.uint8)
    elem = x.view(np.uint8).reshape(rows, cols, eb)
    for b in range(eb):
        smem[off + b] = elem[..., b]
    if np.unique(off).size != off.size:
        raise AssertionError("two elements map to one address: the layout is not a bijection")
    return smem


def wavefronts(addresses, access_bytes=CHUNK):
    """How many passes shared memory needs to serve one request of `access_bytes` per address (16: ldmatrix's or an
    operand fetch's row of a core matrix; the addresses of one 128-byte request). Banks are 4 bytes wide, 32 of
    them: the passes are the largest number of different 4-byte words that fall in one bank."""
    words = {}
    for a in np.asarray(addresses).ravel():
        for w in range(int(a) // BANK_BYTES, (int(a) + access_bytes) // BANK_BYTES):
            words.setdefault(w % BANKS, set()).add(w)
    return max(len(s) for s in words.values())


def dq_store_offsets(nb, *, upper=False, spread=True):
    """Byte offsets, in a consumer's dQ_i buffer, of the 8-byte stores the 32 lanes of a warp make in step nb (0..7)
    of version ws's backward (kernels/flash_v3_backward_ws.cu). The buffer is the copy engine's box layout: 64 rows x
    64 floats as two panels of 32 floats (128-byte rows, 8192 bytes each) in the 128-byte swizzle. Lane 4 g + t holds
    columns 8 n + 2 t, + 1 of accumulator row g (upper: g + 8) for each n-block n. spread=True is the kernel's order:
    lanes of odd g store n-block nb ^ 2 in step nb. spread=False: every lane on n-block nb.

    Shared memory serves 8-byte stores half a warp (16 lanes, 128 bytes) at a time. With every lane on nb, rows
    g = 0..3 put their columns in chunks (2 (nb % 4) + t / 2) ^ g: only 4 chunks, each written twice (two passes).
    Moving the odd rows to nb ^ 2 moves their chunks by 4: each half covers all 8 chunks in one pass."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    n = nb ^ (2 * (g & 1)) if spread else np.full(32, nb)
    col = 8 * n + 2 * t  # the first of the lane's two floats
    return swizzle((col // 32) * 8192 + (g + 8 * upper) * 128 + (col % 32) * 4, 128)


# ---------------------------------------------------------------- the wgmma matrix descriptor
# A 64-bit word that tells wgmma where an operand lives in shared memory and how it is laid out (PTX ISA,
# "Matrix Descriptor Format" of the asynchronous warpgroup MMA). Addresses and offsets are in units of 16 bytes:
#   bits  0-13  start address >> 4           bits 32-45  stride byte offset (SBO) >> 4
#   bits 16-29  leading byte offset (LBO) >> 4   bits 49-51  base offset (0: the tile starts on a pattern boundary)
#   bits 62-63  swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
# For a K-major operand (each row holds consecutive K values, as Q and K do) in a swizzled layout, SBO is the distance
# between groups of 8 rows (8 x the swizzle span: 1024 bytes in the 128-byte mode) and LBO is not used (1 by
# convention). One wgmma for 16-bit inputs consumes K = 16 values (32 bytes) of each row: the next K step is the same
# descriptor with its start address 32 bytes further; the hardware applies the swizzle to the address it forms.
# For an MN-major operand (consecutive N values in a row, as V's rows hold the head dim while the product P V sums
# over its keys), the same tile bytes serve: 64 N values (128 bytes) per line, K rows 128 bytes apart, SBO between
# groups of 8 K rows (1024 bytes), LBO between panels of 64 N values. The next K step (16 keys) starts 2048 bytes
# further (PTX ISA, "Shared Memory Matrix Layout", canonical layouts).
SWIZZLE_CODE = {0: 0, 128: 1, 64: 2, 32: 3}
_FIELD14 = (1 << 14) - 1


def descriptor(start, *, sbo, lbo=16, mode=128):
    """The 64-bit matrix descriptor of an operand at shared-memory byte address start. Raises ValueError for what
    the format cannot hold: unaligned addresses or offsets, values over 14 bits (256 KiB), a swizzled tile that
    does not start on its pattern's boundary (this descriptor keeps base offset 0)."""
    if mode not in SWIZZLE_CODE:
        raise ValueError(f"swizzle mode {mode!r}: choose 128, 64, 32 or 0 (none)")
    for name, v in (("start", start), ("sbo", sbo), ("lbo", lbo)):
        if v % 16 or not 0 <= v >> 4 <= _FIELD14:
            raise ValueError(f"{name} = {v}: must be a multiple of 16 bytes below 256 KiB")
    if mode and start % (8 * mode) >= 128:  # only the K step (inside one 128-byte line) may move the start
        raise ValueError(f"start = {start}: a {mode}-byte swizzled tile starts on a {8 * mode}-byte boundary "
                         "(plus a K step inside its first line)")
    return (start >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | SWIZZLE_CODE[mode] << 62


def decode(desc):
    """{start, lbo, sbo, base_offset, mode} of a descriptor (bytes)."""
    code = desc >> 62 & 3
    return {"start": (desc & _FIELD14) << 4, "lbo": (desc >> 16 & _FIELD14) << 4, "sbo": (desc >> 32 & _FIELD14) << 4,
            "base_offset": desc >> 49 & 7, "mode": {v: k for k, v in SWIZZLE_CODE.items()}[code]}


def read_operand(smem, desc, *, rows, k_bytes=32, elem_dtype=np.uint16):
    """What a K-major wgmma operand read through desc sees: rows x (k_bytes / element size) values, row r and byte
    b of its K step taken from start + (r // 8) SBO + (r % 8) x span + b, swizzled as an address. smem: the bytes
    of shared memory from address 0 (store_tile's output placed at its address)."""
    d = decode(desc)
    span = d["mode"] or CHUNK
    r, b = np.meshgrid(np.arange(rows), np.arange(k_bytes), indexing="ij")
    addr = swizzle(d["start"] + (r // CORE_ROWS) * d["sbo"] + (r % CORE_ROWS) * span + b, d["mode"])
    eb = np.dtype(elem_dtype).itemsize
    return np.ascontiguousarray(smem[addr]).view(elem_dtype).reshape(rows, k_bytes // eb)


def read_operand_mn(smem, desc, *, n, k_rows=16, elem_dtype=np.uint16):
    """What an MN-major wgmma operand (B with imm-trans-b = 1) read through desc sees: k_rows x n values, element
    (k, c) taken from start + (k // 8) SBO + (k % 8) x 128 + (c // 64) LBO + (c % 64) x 2, swizzled as an address
    (16-bit values, the 128-byte mode)."""
    d = decode(desc)
    if d["mode"] != 128:
        raise ValueError("read_operand_mn: the 128-byte mode")
    eb = np.dtype(elem_dtype).itemsize
    k, c = np.meshgrid(np.arange(k_rows), np.arange(n), indexing="ij")
    addr = d["start"] + (k // CORE_ROWS) * d["sbo"] + (k % CORE_ROWS) * 128 + (c // (128 // eb)) * d["lbo"]
    addr = addr + (c % (128 // eb)) * eb
    byte = swizzle(addr[..., None] + np.arange(eb), 128)
    return np.ascontiguousarray(smem[byte]).view(elem_dtype).reshape(k_rows, n)

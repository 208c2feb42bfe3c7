"""Stage 05's speed plumbing for CPU runs, apart from the lesson. The configs that run on a CPU are tiny (64 x 64
matrices), so two costs that have nothing to do with the model take much of a step; a call each takes them back.
The results are the same bits either way: only the time changes. Both are best effort (nothing happens where the
library is not found).

    single_thread_blas()   one BLAS thread: a second one only adds synchronisation at these sizes
    reuse_freed_memory()   freed arrays stay with the process for the next step's arrays of the same sizes
"""
import ctypes


def single_thread_blas():
    """Ask the BLAS numpy already loaded for one thread (what OMP_NUM_THREADS=1 does before numpy is imported).

    The tiny CPU configs multiply 64 x 64 matrices: a second BLAS thread only adds synchronisation, and on a
    loaded 2-core machine it can make a step many times slower. Best effort: nothing happens if no OpenBLAS is
    found (the result is the same either way; only the time changes)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return True
    return False


def reuse_freed_memory(threshold=32 << 20):
    """Have glibc's malloc serve arrays up to `threshold` bytes from its heap and keep what is freed there.

    A training step allocates and frees the same arrays every step (activations, scores, gradients). By default
    glibc maps each array over 128 KiB afresh from the kernel and unmaps it when freed, and the kernel zeroes every
    page on its first touch: on the CPU configs that page-fault work is a large share of a step.
    With a fixed mmap threshold (mallopt M_MMAP_THRESHOLD, which also stops glibc from raising it on its own) and a
    high trim threshold (M_TRIM_THRESHOLD), a freed array's pages stay mapped and the next step reuses them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
    return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(libc.mallopt(m_trim_threshold, 4 * threshold))

"""The runtime hands freed heap pages back to the OS (aspc/drivers/local/memory.py): blocks of a
weight tensor's size, freed after glibc's mmap threshold has risen, stay resident until trimmed."""
import ctypes.util
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes
    from aspc.drivers.local.memory import release_free_memory

    def resident_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(16 << 20))  # a freed mmapped block raises the threshold to its size
    blocks = [libc.malloc(1 << 20) for _ in range(400)]  # 1 MB each: now from the heap
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    pinned = libc.malloc(1 << 20)  # above them: trimming the heap's top alone frees nothing
    for block in blocks:
        libc.free(block)
    held = resident_mb()
    release_free_memory()
    print(held, resident_mb())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc's malloc_trim")
def test_freed_weight_sized_blocks_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    held, after = map(float, out.split())
    assert held > 350 and after < held - 300, (held, after)

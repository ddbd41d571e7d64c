"""Memory measured as hfcp's benchmarks and tests measure it: the peak resident memory growth of a block of work
(CPU: the kernel's peak RSS of the process, reset at the block's start, with glibc's mmap threshold fixed so that
RSS tracks live tensors; CUDA: the allocator's peak), the worst rank's being the figure reported."""
from __future__ import annotations

import gc
import os
import threading
import time

import torch


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def fix_mmap_threshold() -> None:
    """Call at start-up. glibc raises its mmap threshold after every large free, so after a warm-up step large
    tensors come from the heap and RSS stops tracking live memory; a fixed 64 KiB threshold makes every
    large tensor its own mapping, returned to the OS when freed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def trim_heap() -> None:
    """Give the heap's free memory back to the OS, so the next step's RSS growth starts from live memory."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset the kernel's record of this process's peak RSS (VmHWM; Linux 4.0+: clear_refs "5"). False where that
    cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM:")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory growth during a block. CPU: the kernel's own peak (VmHWM, reset at the start: every page
    counted, no sampling), or where that cannot be reset, RSS sampled every 1 ms by a thread; CUDA:
    max_memory_allocated."""

    def __init__(self, device):
        self.device = device

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.device.type == "cpu":
            gc.collect()
            trim_heap()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = self._rss()
        self.kernel_peak = _reset_peak()
        if self.kernel_peak:
            self.base = _status_kib("VmRSS:") * 1024
            return self
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.growth = torch.cuda.max_memory_allocated() - self.base
        elif self.kernel_peak:
            self.growth = _status_kib("VmHWM:") * 1024 - self.base
        else:
            self.running = False
            self.thread.join()
            self.growth = max(self.peak, self._rss()) - self.base

"""Weights on 2 MB pages: one buffer that the decode passes stream from.

A decode pass reads every weight once, front to back. On 4 KB pages the hardware prefetchers stop
at each page's end and every 4 KB costs a TLB miss; on Linux with transparent huge pages set to
`madvise` (the common default) a process gets 2 MB pages only where it asks for them. One-row
bfloat16 products over 269 MB of weights 576 wide (2 threads, an ad hoc C++ loop on this AMD EPYC)
streamed 25.0-25.6 GB/s from 4 KB pages and 29.9-32.1 GB/s from 2 MB pages (docs/performance.md,
"2 MB pages"). The values are copied as they are: nothing a pass computes changes.
"""

from __future__ import annotations

import mmap

import torch

from engine.schema import switches

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


class HugePageArena:
    """`nbytes` of anonymous memory, asked for on 2 MB pages (MADV_HUGEPAGE) before it is touched;
    `place` copies tensors into it one after another. Where the OS has no such advice (not Linux)
    it is plain memory, the same values."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        self.buffer = whole[start:start + nbytes]  # (nbytes,) uint8, starting on a 2 MB boundary
        self.used = 0

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """The bytes `place` needs for these tensors."""
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in the arena (same shape, dtype and values)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.used + nbytes > self.buffer.numel():
            raise ValueError(f"HugePageArena: {nbytes} bytes more do not fit "
                             f"({self.used} of {self.buffer.numel()} used)")
        slot = self.buffer[self.used:self.used + nbytes].view(tensor.dtype).view(tensor.shape)
        slot.copy_(tensor)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return slot


def arena_for(tensors: list[torch.Tensor]) -> HugePageArena | None:
    """An arena for these tensors where they are all in CPU memory, unless VLM_HUGE_PAGES=0 or there are none."""
    if not switches().huge_pages or not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    return HugePageArena(HugePageArena.size_of(tensors))

"""The raw CUDA copies and events of the direct path (gpumigrate/cudacalls.py).

On a host without CUDA there is no runtime and the direct path keeps torch's calls; on the lent GPU
(``gpu`` marker) raw copies move bytes both ways between pinned slots and the device, in stream order,
and the thread's current device is left as it was.
"""

from __future__ import annotations

import pytest
import torch

from gpumigrate import cudacalls
from gpumigrate.transfer.buffers import PinnedSlots


def test_without_cuda_there_is_no_runtime_and_events_are_torch_ones() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the gpu test covers it")
    assert cudacalls.runtime() is None


@pytest.mark.gpu
def test_raw_copies_round_trip_through_a_pinned_slot_in_stream_order() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rt = cudacalls.runtime()
    assert rt is not None
    dev = torch.device("cuda", torch.cuda.current_device())
    slots = PinnedSlots(1 << 20, 2)
    src = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device=dev)
    back = torch.zeros_like(src)
    stream = torch.cuda.Stream(device=dev)
    before = torch.cuda.current_device()
    cudacalls.recorded(dev, torch.cuda.current_stream(dev)).wait_on(stream.cuda_stream)
    cudacalls.copy(rt, dev.index or 0, slots.address(1) + 4096, src.data_ptr(), src.numel(), stream.cuda_stream)
    cudacalls.copy(rt, dev.index or 0, back.data_ptr(), slots.address(1) + 4096, src.numel(), stream.cuda_stream)
    done = cudacalls.recorded(dev, stream)
    assert isinstance(done, cudacalls.Event)
    done.synchronize()
    assert torch.equal(back, src)
    assert bytes(slots.view(1)[4096 : 4096 + 100]) == bytes(src[:100].cpu().numpy())
    assert torch.cuda.current_device() == before


@pytest.mark.gpu
def test_the_plane_split_kernel_matches_torch_for_chunks_anywhere() -> None:
    """One launch splits chunks of different lengths in different allocations (before and after the first)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from gpumigrate.transfer.device import gpucodec

    g = torch.Generator(device="cuda").manual_seed(5)
    blocks = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in (70_002, 1 << 20, 9_000)
    ]
    views = [blocks[1][: 1 << 20], blocks[0][2:], blocks[2][100:8_100], blocks[1][4096 : 4096 + 65_536]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    split = gpucodec.PlaneSplit(views, stream)
    assert split.buffer is not None  # the kernel took them (Triton is on the GPU host)
    assert all(split.low(i).ptr % 16 == 0 and split.high(i).ptr % 16 == 0 for i in range(len(views)))  # nvCOMP's inputs
    stream.synchronize()
    for i, v in enumerate(views):
        want = v.view(-1, 2).t().contiguous()
        assert torch.equal(torch.as_tensor(split.low(i), device="cuda"), want[0])
        assert torch.equal(torch.as_tensor(split.high(i), device="cuda"), want[1])


@pytest.mark.gpu
def test_the_plane_merge_kernel_interleaves_planes_by_address() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from gpumigrate.transfer.device import gpucodec, plane_kernels

    plane_kernels.warm(torch.device("cuda"))  # the SDK's warm-up compiles both kernels, both alignments
    src = (torch.randn(300_001, device="cuda") * 3).to(torch.bfloat16).view(torch.uint8)
    planes = src.view(-1, 2).t().contiguous()
    out = torch.zeros_like(src)
    assert gpucodec.merges(out)
    plane_kernels.merge(planes.data_ptr(), planes.data_ptr() + src.numel() // 2, out)
    torch.cuda.synchronize()
    assert torch.equal(out, src)
    odd = torch.zeros(src.numel() + 2, dtype=torch.uint8, device="cuda")[2:]  # a destination off 16-byte alignment
    plane_kernels.merge(planes.data_ptr(), planes.data_ptr() + src.numel() // 2, odd)
    torch.cuda.synchronize()
    assert torch.equal(odd, src)

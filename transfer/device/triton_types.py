"""Types for the Triton kernels (``devhash_kernels.py``, ``plane_kernels.py``): Triton ships no type information.

Inside a kernel every value is a ``tl.tensor`` (a block of lanes, a scalar or a pointer) and kernels say so in their
annotations, which Triton's compiler reads only for ``tl.constexpr``. :func:`device_function` marks a function
that kernels call, :func:`kernel` one that is launched (``kernel[grid](...)``); both compile with ``triton.jit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Kernel(Protocol):
    """A compiled Triton kernel: ``kernel[grid](*args)`` launches it on the current CUDA stream."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...


def device_function(fn: F) -> F:
    """``triton.jit`` for a function that kernels call (it stays callable from them alone)."""
    import triton

    compiled: F = triton.jit(fn)
    return compiled


def kernel(*, do_not_specialize: Sequence[str] = ()) -> Callable[[Callable[..., None]], Kernel]:
    """``triton.jit`` for a launched kernel; ``do_not_specialize`` as Triton's (one compile for every value)."""

    def compile_kernel(fn: Callable[..., None]) -> Kernel:
        import triton

        compiled: Kernel = (
            triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)
        )
        return compiled

    return compile_kernel

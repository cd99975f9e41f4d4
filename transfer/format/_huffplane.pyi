"""Types of the compiled byte-plane Huffman coder (``_huffplane.c``; FORMAT.md, plane codec 2)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

Bytes = Buffer | npt.NDArray[np.uint8]  # numpy's arrays are buffers, which its stubs do not say before Python 3.12

HEADER_BYTES: int
MAXBITS: int

def merge(planes: Sequence[Bytes], out: Bytes, /) -> None: ...
def split(data: Bytes, k: int, out: Bytes, /) -> None: ...
def encode(plane: Bytes, out: Bytes, /) -> int: ...
def decode(payload: Bytes, out: Bytes, /) -> None: ...

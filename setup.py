"""Only the C extension lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # transfer/FORMAT.md, plane codec 2: the byte-plane Huffman coder (why it is C: _huffplane.c)
        Extension(
            "gpumigrate.transfer.format._huffplane",
            ["transfer/format/_huffplane.c"],
            extra_compile_args=["-O3", "-std=c11"],
        ),
    ],
)

"""The image format (``FORMAT.md`` beside this package): manifests (``manifest.py``), chunk objects
(``chunkobj.py``), image keys (``keys.py``), the chunk codecs (``codecs.py``) and the byte-plane coders
(``planehuff.py`` over ``_huffplane.c``, ``planezstd.py``).
"""

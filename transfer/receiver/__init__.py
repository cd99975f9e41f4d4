"""The receiver behind ``stream://`` and ``nixl://`` (TRANSPORTS.md, Receiver), and a receiver on a host.

``server.py`` serves the connections (TLS, ``tls.py``) and requests; ``verified.py`` is what it keeps (only verified
chunks, under a quota); ``landing.py`` its NIXL landing pool; ``host.py`` runs a receiver on a target host (its
state directory, the detached process, ``receiver.json``, stopping it).
"""

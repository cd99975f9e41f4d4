"""Helpers shared by the test folders (importable as ``tests.support``: tests/conftest.py puts the repository on
sys.path): an in-process image sink (``memimage.py``) and the plans the flow tests migrate (``plans.py``)."""

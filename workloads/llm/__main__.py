import os
import sys

from .main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Everything is closed by now; skipping interpreter finalization saves seconds of torch teardown.
os._exit(code)

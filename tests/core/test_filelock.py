"""A stop signal never leaves a gpumigrate file lock held (gpumigrate/filelock.py).

The children are real processes. The first has a handler with the stopper's contract (SIGTERM raises where the main
thread is, unless a lock defers it), and keeps every exception alive as Prefect keeps one in a run's state. It
takes the migration's real state and audit locks, and sends itself the signal at each step in turn, counted
by a trace function (every line, call and return of the lock code, ``contextlib``'s included), so every window a
signal can hit is hit. After each one a fresh file descriptor must take each lock at once. Before the fix the
state lock was left held at the 95th step of about 240. The second child runs the real stopper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EVERY_STEP = r"""
import fcntl, json, os, signal, sys
from gpumigrate import filelock
from gpumigrate.state import Migration

class Stop(BaseException):
    pass

def on_term(signum, frame):  # the stopper's contract (flows/stopping.py)
    stop = Stop()
    if filelock.defer(stop):
        return
    raise stop

signal.signal(signal.SIGTERM, on_term)
m = Migration.create(plan_text="version: 1\n", migration_id="locks")
locks = [m.dir / ".state.lock", m.audit.path]

def take():
    with m._locked():
        with m.audit._locked():
            pass
    with m.audit._locked():
        pass

def free(path):
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)

take()
kept, leaked, stops, step = [], [], 0, 0
while not leaked:
    step += 1
    seen = 0
    def tracer(frame, event, arg):
        global seen
        seen += 1
        if seen == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return tracer
    sys.settrace(tracer)
    try:
        take()
        take()
    except Stop as exc:
        stops += 1
        kept.append(exc)  # alive, with its traceback and every frame it went through
    finally:
        sys.settrace(None)
    leaked = [str(p) for p in locks if not free(p)]
    if seen < step:  # past the last step: every one was tried
        break
print(json.dumps({"steps": step, "stops": stops, "leaked": leaked}))
"""

REAL_STOPPER = r"""
import fcntl, json, os, signal
from prefect.exceptions import TerminationSignal
from gpumigrate.flows import stopping
from gpumigrate.state import Migration

m = Migration.create(plan_text="version: 1\n", migration_id="stop-locked")
order = []
with stopping.on_signals(m.id, lambda result: None):
    try:
        with m._locked():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecodes; it must not raise in here
                pass
            order.append("lock body ended")
    except TerminationSignal:
        fd = os.open(m.dir / ".state.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the lock were still held
        order.append("raised after the lock was let go")
print(json.dumps(order), flush=True)
os._exit(0)  # before the stopper's watchdog would act (its grace is seconds)
"""


def _run(code: str, tmp_path: Path) -> str:
    env = {**os.environ, "GPUMIGRATE_HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "xdg")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_sigterm_at_every_step_of_a_lock_leaves_no_lock_held(tmp_path: Path) -> None:
    report = json.loads(_run(EVERY_STEP, tmp_path))
    assert report["leaked"] == [], f"a lock left held by a SIGTERM at step {report['steps']}: {report['leaked']}"
    assert report["steps"] > 100 and report["stops"] >= report["steps"] - 5, report  # every step was a real stop


def test_the_stopper_raises_once_the_lock_is_let_go(tmp_path: Path) -> None:
    assert json.loads(_run(REAL_STOPPER, tmp_path)) == ["lock body ended", "raised after the lock was let go"]

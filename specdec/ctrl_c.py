"""Ctrl-C at every moment of a script: one line on stderr, exit code 130, and nothing the user
keeps replaced. It imports nothing of the project and nothing slow, so that an entry script can
import it first, before torch; cli.run() uses it.

    import specdec.ctrl_c            # an entry script's first import: Ctrl-C while it imports
    with ctrl_c.counted(): ...       # cli.run's, around the script's work: each press counted
    ctrl_c.check()                   # KeyboardInterrupt for a press whose exception was lost
    ctrl_c.handled()                 # code that caught KeyboardInterrupt to go on says so
    ctrl_c.exit_now(code)            # an entry script's last call, for sys.exit(code)

Python's own handler raises KeyboardInterrupt wherever the program is. Three moments need more:
  - while the script imports torch and the rest (seconds), where that exception prints a
    traceback of forty lines: imported first by the script, this module's handler writes the one
    line and exits at once (nothing has been done yet, so nothing is lost);
  - where the exception is raised inside a finalizer (a __del__ that third-party code runs as it
    frees an object, say while a tokenizer loads): Python prints "Exception ignored in ..." and
    drops it, and the script would go on as if no key had been pressed, to the end, replacing the
    --out file the user meant to keep. So while cli.run() runs a script each press is counted too,
    a lost one is not printed, and check() raises it again where going on would cost the user
    something (after a model loads, before an output file is opened or a line written); run()
    honours it at the end;
  - after the work, while Python shuts down (a second or more once torch is loaded), where a
    press would end the process by the signal, with no line: the script's handler is then
    at_end's one line, and exit_now() ends the process without the shutdown, its files written
    and closed and its streams flushed.

Test: `python -m pytest -q tests/test_interrupts.py`.
"""

import contextlib
import os
import signal
import sys
import threading

EXIT = 130  # 128 + SIGINT: what a shell reports for a program Ctrl-C stopped
pressed = 0  # presses while counted() that no code has handled yet


# --- while the script imports ---------------------------------------------------------------------


def at_start(signum, frame):
    """SIGINT's handler from the script's first import until cli.run() starts: one line, exit."""
    os.write(2, b"\n[interrupted by Ctrl-C while starting; nothing was done]\n")
    os._exit(EXIT)


def imported_by_the_script():
    """Whether this module is being imported by a statement of the script Python runs (its
    __main__: python generate.py), not by a test or a program that imports the script: only there
    is SIGINT the script's to handle."""
    frame = sys._getframe()
    while frame is not None and (
        frame.f_globals.get("__name__") == __name__
        or frame.f_code.co_filename.startswith("<frozen importlib")
    ):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "__main__"


def at_end(signum, frame):
    """SIGINT's handler once cli.run() has returned: one line, exit."""
    os.write(2, b"\n[interrupted by Ctrl-C while exiting]\n")
    os._exit(EXIT)


def exit_now(code):
    """An entry script's last call, for sys.exit(code): its work is done and its files closed, so
    the process ends now, its streams flushed, without Python's shutdown, in which a Ctrl-C would
    end it by the signal, with no line."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: nothing more to say
            pass
    os._exit(code)


if imported_by_the_script() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, at_start)


# --- while the script runs ------------------------------------------------------------------------


def count(signum, frame):
    """SIGINT's handler inside counted(): Python's KeyboardInterrupt, the press counted."""
    global pressed
    pressed += 1
    raise KeyboardInterrupt


def check():
    """Raise KeyboardInterrupt if Ctrl-C was pressed and no code has seen its exception (a
    finalizer swallowed it)."""
    if pressed:
        raise KeyboardInterrupt


def handled():
    """Code that caught KeyboardInterrupt and goes on (the chat: Ctrl-C stops a reply) forgets the
    presses, so that check() does not raise them again."""
    global pressed
    pressed = 0


@contextlib.contextmanager
def counted():
    """Within it, Ctrl-C raises KeyboardInterrupt as ever and is counted, and a KeyboardInterrupt
    that a finalizer swallowed is not printed (check() raises it again). Only in the main thread,
    where SIGINT is Python's to handle (not ignored, not an application's); after it, SIGINT is
    Python's own handler again."""
    global pressed
    pressed = 0
    previous = signal.getsignal(signal.SIGINT)
    main = threading.current_thread() is threading.main_thread()
    if not main or previous not in (signal.default_int_handler, at_start):
        yield
        return
    unraisable = sys.unraisablehook

    def quiet(failure):  # "Exception ignored in ...": not for a press, which is counted
        if not issubclass(failure.exc_type, KeyboardInterrupt):
            unraisable(failure)

    signal.signal(signal.SIGINT, count)
    sys.unraisablehook = quiet
    try:
        yield
    finally:  # at_start's time is over; a script's own SIGINT now ends it with at_end's line
        signal.signal(signal.SIGINT, at_end if previous is at_start else signal.default_int_handler)
        sys.unraisablehook = unraisable


@contextlib.contextmanager
def deferred():
    """Within it Ctrl-C raises nothing: each press is appended to the list it yields, and the work
    inside (reporting and writing what was measured) is never cut; the caller decides after it.
    Only in the main thread (elsewhere it defers nothing)."""
    presses = []
    if threading.current_thread() is not threading.main_thread():
        yield presses
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: presses.append(signum))
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)

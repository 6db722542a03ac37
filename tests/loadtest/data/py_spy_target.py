"""A tiny Python process for py-spy to sample (tests/loadtest/test_ab_profile.py):
its main thread squares numbers in ``outer`` -> ``squares``, a second thread
sorts in ``background`` -> ``sort_back``, for SECONDS (argument, default 3).
It prints "ready" once both are at work.

tests/loadtest/data/py-spy-raw.txt was recorded from it, in this folder:
``py-spy record -p PID -d 1 -r 100 --function --format raw -o py-spy-raw.txt``
while ``python py_spy_target.py`` ran (PID: its process).
"""

import sys
import threading
import time


def squares(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def outer() -> int:
    return squares(20_000)


def sort_back() -> list[int]:
    return sorted(range(3_000), key=lambda x: -x)


def background(until: float) -> None:
    while time.monotonic() < until:
        sort_back()


until = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)
threading.Thread(target=background, args=(until,)).start()
outer()
print("ready", flush=True)
while time.monotonic() < until:
    outer()

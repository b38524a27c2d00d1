"""Sweeps this user's stale segments every 10 ms for 60 s: run beside the stale-segment tests to
reproduce the race another pytest worker's job start caused (eighteenth session)."""

import time
import warnings

from sysx.memory import cleanup

warnings.simplefilter("ignore")
n = 0
t0 = time.monotonic()
while time.monotonic() - t0 < 60:
    n += len(cleanup.sweep_stale())
    time.sleep(0.01)
print("sweeper removed", n)

"""Sets the GIL's switch interval from SYSX_EXP_SWITCH (seconds) in every Python process started
with this folder on PYTHONPATH: the A/B of gil_switch_ab.sh (RESULTS.md, fifth session)."""

import os
import sys

if os.environ.get("SYSX_EXP_SWITCH"):
    sys.setswitchinterval(float(os.environ["SYSX_EXP_SWITCH"]))

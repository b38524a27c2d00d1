"""A rank of a multi-process job keeps libtorch's warnings about a dead peer off stderr (its own
one-line report says it); one process, or a user's explicit TORCH_CPP_LOG_LEVEL, keeps them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A TCPStore client whose server was SIGKILLed: c10d prints a warning with a C++ stack on the read.
STORE_HOST_DIES = """
import datetime, subprocess, sys, time
from sysx.rank_env import quiet_peer_warnings
quiet_peer_warnings()
import torch.distributed as dist
host = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                         "s = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False); print(s.port, flush=True); time.sleep(120)"],
                        stdout=subprocess.PIPE, text=True)
port = int(host.stdout.readline())
client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
client.set("news", "none")
host.kill()
host.wait()
try:
    client.check(["news"])
except Exception as err:
    print(type(err).__name__)
"""


def run_client(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}
    base.pop("TORCH_CPP_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-c", STORE_HOST_DIES], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("env", "warned"),
    [({"WORLD_SIZE": "2"}, False), ({}, True), ({"WORLD_SIZE": "2", "TORCH_CPP_LOG_LEVEL": "WARNING"}, True)],
)
def test_a_rank_does_not_print_c10d_warnings_about_a_dead_store_host(env: dict[str, str], warned: bool) -> None:
    out = run_client(env)
    assert out.returncode == 0, out.stderr
    assert "DistNetworkError" in out.stdout, (out.stdout, out.stderr)  # the read failed: the case happened
    assert ("TCPStore.cpp" in out.stderr) == warned, out.stderr

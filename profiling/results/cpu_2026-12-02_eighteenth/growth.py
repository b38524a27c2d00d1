"""One process's host growth past its baseline (what the prediction check measures), for a
1-process pipeline job: run from a checkout with PYTHONPATH=. (eighteenth session, issue 27).
    PYTHONPATH=. python growth.py RUN_DIR"""

import sys

import sysx.trainers.pipeline as pipe
import sysx.trainers.prediction as pred

base = {}
orig = pred.start_host_peak


def patched():
    base["v"] = orig()
    return base["v"]


pipe.start_host_peak = patched
from sysx.train import main  # noqa: E402  (imported after the patch)

main(
    [
        "schedule=sysx",
        "train.steps=6",
        "train.seq_len=64",
        "train.micro_batch_size=2",
        "optim.backend=torch",
        "eval.every=0",
        "log.progress=false",
        "run_dir=" + sys.argv[1],
    ]
)
print("GROWTH_MIB %.1f" % (pred.host_growth(base["v"]) / 2**20))

"""``optim.offload=nvme``: the fp32 optimizer state in files on a local NVMe drive, streamed per
backward sub-stage (or window group) through reused page-locked staging buffers."""

"""The datasheet peak of a GPU, the denominator of MFU: dense (no 2:4 sparsity) 16-bit tensor
FLOP/s with fp32 accumulation, looked up by the name ``torch.cuda.get_device_name`` reports.
MFU is taken against this peak whatever ``precision`` runs (as torchtitan and nanoGPT do); an
unknown GPU has no MFU rather than a guessed one."""

from __future__ import annotations

# (a part of the device name, dense bf16/fp16 TFLOP/s): the first part found in the name wins, so a
# longer name comes before a name it contains ("H100 NVL" before "H100", "L40S" before "L4").
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM (the "80GB HBM3" name)
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("V100S", 130.0),
    ("V100-PCIE", 112.0),
    ("V100", 125.0),  # SXM2 / SXM3
    ("MI300X", 1307.0),
)


def peak_flops_per_s(device_name: str) -> float | None:
    """The dense 16-bit peak FLOP/s of the GPU called ``device_name``, or None when it is not in :data:`PEAK_TFLOPS`."""
    for part, tflops in PEAK_TFLOPS:
        if part in device_name:
            return tflops * 1e12
    return None

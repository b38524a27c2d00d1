"""Measurements of this machine that several layers use: the hardware profile (:mod:`.hardware`,
cached per machine by :mod:`.hardware_cache`) and one CPU Adam thread's rate (:mod:`.adam_rate`).

It sits below the runtime, the single-GPU engine and the autotuner, which all read it, and
imports only the device, memory and optimizer-kernel modules it measures.
"""

"""Autotune (ProTrain): profile the machine and model, predict with the simulator, choose the
pipeline configuration under the memory budgets. ``sysx tune`` is :mod:`sysx.autotune.cli`."""

"""Single-GPU training with the AdaWS sliding window (``schedule=single``).

All training state lives in host memory; a window of consecutive blocks lives on the device in
ring buffers carved from one preallocated buffer, and slides forward then backward while copies
run on their own streams; each block's CPU Adam steps as soon as its gradients are home. The job
is :mod:`sysx.trainers.single`, the settings :class:`sysx.config.SingleSection`. Submodules are
imported on use so that importing the package stays cheap.
"""

"""Single-GPU training with the AdaWS sliding window (``schedule=single``).

All training state lives in host memory; a window of consecutive blocks lives on the device in
ring buffers carved from one preallocated buffer, and slides forward then backward while copies
run on their own streams; each block's CPU Adam steps as soon as its gradients are home.

Modules: :mod:`~sysx.single.hardware` (measured or assumed figures), :mod:`~sysx.single.planner`
(micro-batch, window and budgets; refuses impossible plans), :mod:`~sysx.single.act_policy` (the DP
for saved activations, PyAO's rule), :mod:`~sysx.single.op_profile` (a layer's ops, bytes and FLOPs),
:mod:`~sysx.single.act_capture` (saving op outputs and reusing them in the recompute), :mod:`~sysx.single.compress` (int8 activations), :mod:`~sysx.single.rings`
(arena, rings, per-slot events), :mod:`~sysx.single.host` (host state, CPU Adam thread),
:mod:`~sysx.single.executor` (the sliding window) and :mod:`~sysx.single.plan_cmd` (``sysx plan-single``);
the planner's inputs, level costs, save-level choice and printed plan are :mod:`~sysx.single.plan_request`,
:mod:`~sysx.single.plan_costs`, :mod:`~sysx.single.plan_levels` and :mod:`~sysx.single.plan_report`. The ``single.*`` settings are
:class:`sysx.config.SingleSection`.
The job that drives them is :mod:`sysx.trainers.single`. Submodules are imported on use so that importing the package stays cheap.
"""

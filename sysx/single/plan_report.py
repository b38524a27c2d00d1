"""The chosen single-GPU plan (:class:`SinglePlan`): configuration, memory accounting, predicted
timing and the reasons, and how it is printed."""

from __future__ import annotations

from dataclasses import dataclass

from sysx.machine.hardware import HardwareProfile
from sysx.single.plan_costs import LevelTable, PolicyRow
from sysx.single.plan_request import ModelSizes, PlanRequest, gib


@dataclass(frozen=True)
class SinglePlan:
    """The chosen configuration, its memory accounting, predicted timing and the reasons."""

    request: PlanRequest
    hardware: HardwareProfile
    sizes: ModelSizes
    chunk: int  # b: sequences per chunk (the micro-batch the model computes at once)
    chunks: int  # chunks per round
    seq_chunk: int  # C: tokens per sequence chunk (train.seq_len: sequences are not chunked)
    rounds: int  # rounds per step
    window: int  # W
    r_param: int
    r_grad: int
    r_act: int
    slot_level: int  # option the activation slots are sized for (window blocks use it)
    levels: tuple[int, ...]  # option of every block (the last W: slot_level)
    table: LevelTable
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    device_budget: int
    host_budget: int
    overlap: str  # "backward" (step as grads arrive), "forward" (after the norm) or "auto" (adaptive)
    feasible_no_stall: bool
    stall_s: float
    times: dict[str, float]
    policy_rows: tuple[PolicyRow, ...]
    reasons: tuple[str, ...] = ()
    keep_graph: bool = False  # every block keeps its forward's autograd graph (slots hold the inputs)

    @property
    def round_sequences(self) -> int:
        """``X``: sequences per round."""
        return self.chunk * self.chunks

    @property
    def seq_chunks(self) -> int:
        """Sequence chunks per sequence ``S / C`` (1: whole sequences)."""
        return self.request.seq_len // self.seq_chunk

    @property
    def units(self) -> int:
        """Units per block per round (chunk of sequences, sequence chunk): what an activation slot holds."""
        return self.chunks * self.seq_chunks

    @property
    def micro_batches(self) -> int:
        """Chunks per step (each is one ``get_batch`` micro-batch of ``chunk`` sequences)."""
        return self.chunks * self.rounds

    @property
    def transfer_layers(self) -> int:
        """Blocks whose activations go to host memory: the first ``L - W``."""
        return self.sizes.n_blocks - self.window

    def render(self) -> str:
        """The printed plan: decisions with their reasons, memory and the policy comparison."""
        r = self.request
        lines = [
            f"sysx single-GPU plan (AdaWS sliding window) on {self.hardware.name}",
            f"  model: {self.sizes.n_blocks} blocks x {self.sizes.block_params / 1e6:.1f}M params + embedding/head "
            f"{self.sizes.static_params / 1e6:.1f}M = {self.sizes.total_params / 1e9:.3f}B, {r.precision}; seq_len {r.seq_len}; "
            f"global batch {r.global_batch} sequences = {r.global_batch * r.seq_len} tokens/step (kept)",
            f"  budgets: device {gib(self.device_budget)}, host {gib(self.host_budget)}",
            f"  -> {self.rounds} rounds x {self.chunks} chunks x {self.chunk} sequences"
            + (f" in {self.seq_chunks} sequence chunks of {self.seq_chunk} tokens" if self.seq_chunks > 1 else "")
            + f"; window W={self.window} of "
            f"{self.sizes.n_blocks} blocks; rings R_param={self.r_param}, R_grad={self.r_grad}, R_act={self.r_act}; "
            f"optimizer overlap: {self.overlap}",
        ]
        lines += [f"  * {reason}" for reason in self.reasons]
        lines.append(
            "  device memory: "
            + ", ".join(f"{k} {gib(v)}" for k, v in self.device_bytes.items() if k != "total")
            + f" = {gib(self.device_bytes['total'])} of {gib(self.device_budget)}"
        )
        lines.append(
            "  host memory: "
            + ", ".join(f"{k} {gib(v)}" for k, v in self.host_bytes.items() if k != "total")
            + f" = {gib(self.host_bytes['total'])} of {gib(self.host_budget)}"
        )
        lines.append("  saved-activation options (per step, same window; the choice is marked *):")
        lines.append("    policy        offload/step  recompute/step   stall/step  predicted step")
        for row in self.policy_rows:
            mark = "*" if row["chosen"] else " "
            lines.append(
                f"   {mark}{row['policy']:<13} {gib(row['offload_bytes']):>12}  {row['recompute_s'] * 1e3:>11.1f} ms"
                f"  {row['stall_s'] * 1e3:>10.1f} ms  {row['step_s'] * 1e3:>11.1f} ms"
            )
        t = self.times
        lines.append(
            f"  predicted: {t['step_s'] * 1e3:.1f} ms/step, {t['tokens_per_s']:.0f} tokens/s "
            f"(block forward per round {t['block_fwd_round_s'] * 1e3:.2f} ms, weights in {t['t_param_s'] * 1e3:.2f} ms, "
            f"grads out {t['t_grad_s'] * 1e3:.2f} ms)"
        )
        return "\n".join(lines)

"""Pictures of simulated timelines (like the SysX paper's Figures 2 and 8) and Chrome traces.

:func:`draw` writes a PNG: per rank one GPU row (forward passes in a blue series, backward passes
in a yellow series, a shade per stage the rank runs), one copy row (parameter prefetch ``p`` in
mint, gradient offload ``g`` in pink, checkpoint transfers ``c`` in grey; zero-cost copies as
ticks), one CPU row (optimizer steps ``o`` in green, overlapping steps in sub-lanes) and, with
replicas, one reduce row (each unit's gradient reduction and the end-of-step shard exchange in
orange). Boxes
wide enough carry labels ``f_i^j``, ``b_{i,k}^j``, ``o_{i,k}``. :func:`draw_compare` stacks
several timelines on one time axis. :func:`chrome_trace` writes JSON that opens in Perfetto.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from sysx.schedule.ops import OpKind
from sysx.schedule.simulate import Event, Timeline

FWD_COLORS = ("#1f5fa8", "#7cc4f0", "#2b8cbe", "#bfe3fa", "#08306b", "#4f9fd6")
BWD_COLORS = ("#fff3a3", "#ffd21f", "#ff9a1f", "#9c5a2a", "#ffe066", "#e0a800", "#d9731a", "#6b3a1a")
OPT_COLOR = "#3cab4b"
LOAD_COLOR = "#8fe3c0"
OFFLOAD_COLOR = "#f59ac8"
P2P_COLOR = "#9e9e9e"
REDUCE_COLOR = "#f39c12"
DARK = {"#1f5fa8", "#2b8cbe", "#08306b", "#4f9fd6", "#9c5a2a", "#6b3a1a", "#3cab4b"}


_SUBS = str.maketrans("0123456789,", "₀₁₂₃₄₅₆₇₈₉,")
_SUPS = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def _sub(s: int, k: int, split: int) -> str:
    return (f"{s}" if k < 0 or split == 1 else f"{s},{k}").translate(_SUBS)


def _label(ev: Event, split: int) -> str:
    """``f₃²``, ``b₅,₁⁰``, ``o₅,₁``, ``p₄``, ``g₅,₁``, ``c₀,₁²`` (Unicode: fast to draw)."""
    op = ev.op
    k = op.kind
    mb = str(op.mb).translate(_SUPS)
    if k == OpKind.FORWARD:
        return "f" + _sub(op.stage, -1, split) + mb
    if k == OpKind.BACKWARD:
        return "b" + _sub(op.stage, op.sub, split) + mb
    if k == OpKind.OPTIM_STEP:
        return "o" + _sub(op.stage, op.sub, split)
    if k == OpKind.LOAD_PARAMS:
        return "p" + _sub(op.stage, op.sub, split)
    if k == OpKind.OFFLOAD_GRADS:
        return "g" + _sub(op.stage, op.sub, split)
    if k == OpKind.SEND_CKPT:
        return "c" + _sub(op.stage, op.sub, split) + mb
    return ""


def _colors(tl: Timeline) -> dict[tuple[int, int, int], str]:
    """Colour of each (rank, stage, sub) pass: shades in the order the rank first runs them."""
    out: dict[tuple[int, int, int], str] = {}
    nf: dict[int, int] = {}
    nb: dict[int, int] = {}
    for ev in sorted((e for e in tl.events if e.lane == "gpu"), key=lambda e: e.start):
        op = ev.op
        key = (ev.rank, op.stage, op.sub if op.kind == OpKind.BACKWARD else -2)
        if key in out:
            continue
        if op.kind == OpKind.FORWARD:
            i = nf.get(ev.rank, 0)
            nf[ev.rank] = i + 1
            out[key] = FWD_COLORS[i % len(FWD_COLORS)]
        else:
            i = nb.get(ev.rank, 0)
            nb[ev.rank] = i + 1
            out[key] = BWD_COLORS[i % len(BWD_COLORS)]
    return out


def _sublanes(events: list[Event]) -> list[int]:
    """Greedy lane assignment so that overlapping boxes of one row do not cover each other."""
    ends: list[float] = []
    lanes = []
    for ev in events:
        for i, e in enumerate(ends):
            if e <= ev.start + 1e-12:
                ends[i] = ev.end
                lanes.append(i)
                break
        else:
            ends.append(ev.end)
            lanes.append(len(ends) - 1)
    return lanes


def title_of(tl: Timeline) -> str:
    """One-line description of a timeline for titles and tables."""
    sch = tl.schedule
    name = tl.name
    extra = ""
    if sch is not None:
        if sch.options.cfg is not None and name == "sysx":
            name = f"sysx CFG{sch.options.cfg}"
        extra = f"  Ng={sch.n_ranks} Nm={sch.n_micro} Nsf={sch.n_stages}" + (f" d={sch.split}" if sch.split > 1 else "")
    unit = "" if tl.unit == "units" else " s"
    return f"{name}{extra}   iteration {tl.iteration:.4g}{unit}   bubble {100 * tl.bubble_ratio:.1f}%"


def _rows(
    by: dict[tuple[int, str], list[Event]], R: int
) -> tuple[dict[tuple[int, str], tuple[float, float]], list[tuple[str, float, float]], float]:
    """Where each rank's rows lie: ``(rank, lane) -> (y bottom, height)``, the labelled rows and the top."""
    rows: list[tuple[str, float, float]] = []  # (label, y bottom, height)
    y = 0.0
    gpu_h, cp_h, cpu_lane_h = 1.0, 0.42, 0.42
    layout: dict[tuple[int, str], tuple[float, float]] = {}
    for r in reversed(range(R)):
        if (r, "reduce") in by:  # replicas: the reducer thread and the shard exchange
            layout[(r, "reduce")] = (y, cp_h)
            rows.append((f"reduce{r}", y, cp_h))
            y += cp_h + 0.08
        cpu = sorted(by.get((r, "cpu"), []), key=lambda e: e.start)
        n_cpu = max(_sublanes(cpu), default=-1) + 1
        if n_cpu:
            layout[(r, "cpu")] = (y, cpu_lane_h)
            rows.append((f"CPU{r}", y, cpu_lane_h * n_cpu))
            y += cpu_lane_h * n_cpu + 0.08
        layout[(r, "copy")] = (y, cp_h)
        rows.append((f"copy{r}", y, cp_h))
        y += cp_h + 0.08
        layout[(r, "gpu")] = (y, gpu_h)
        rows.append((f"GPU{r}", y, gpu_h))
        y += gpu_h + 0.35
    return layout, rows, y


def _panel(ax, tl: Timeline, xmax: float, px_per_unit: float) -> None:
    split = tl.schedule.split if tl.schedule is not None else 1
    colors = _colors(tl)
    R = tl.n_ranks
    by: dict[tuple[int, str], list[Event]] = {}
    for ev in tl.events:
        by.setdefault((ev.rank, ev.lane), []).append(ev)
    layout, rows, top = _rows(by, R)

    def box(x0: float, w: float, yb: float, h: float, color: str, text: str) -> None:
        ax.add_patch(_rect(x0, yb, w, h, color))
        if text and w * px_per_unit >= 5.5 * len(text) + 6:
            ax.text(
                x0 + w / 2,
                yb + h / 2,
                text,
                ha="center",
                va="center",
                fontsize=7 if h >= 1 else 6,
                color="white" if color in DARK else "black",
                clip_on=True,
            )

    for r in range(R):
        yb, h = layout[(r, "gpu")]
        for ev in by.get((r, "gpu"), []):
            op = ev.op
            c = colors[(r, op.stage, op.sub if op.kind == OpKind.BACKWARD else -2)]
            box(ev.start, ev.end - ev.start, yb, h, c, _label(ev, split))
        yb, h = layout[(r, "copy")]
        copies = by.get((r, "h2d"), []) + by.get((r, "d2h"), []) + by.get((r, "p2p"), [])
        for ev in copies:
            k = ev.op.kind
            if k == OpKind.LOAD_PARAMS:
                c, yy, hh = LOAD_COLOR, yb + h / 2, h / 2
            elif k == OpKind.OFFLOAD_GRADS:
                c, yy, hh = OFFLOAD_COLOR, yb, h / 2
            else:
                c, yy, hh = P2P_COLOR, yb, h / 2
            if ev.end - ev.start > 0:
                box(ev.start, ev.end - ev.start, yy, hh, c, _label(ev, split))
            elif k in (OpKind.LOAD_PARAMS, OpKind.OFFLOAD_GRADS):
                ax.plot([ev.start, ev.start], [yy, yy + hh], color=c, lw=1.6, solid_capstyle="butt")
        for ev in by.get((r, "reduce"), []):  # replicas: reductions and the shard exchange
            box(ev.start, ev.end - ev.start, *layout[(r, "reduce")], REDUCE_COLOR, "")
        if (r, "cpu") in layout:
            yb, h = layout[(r, "cpu")]
            cpu = sorted(by.get((r, "cpu"), []), key=lambda e: e.start)
            for ev, lane in zip(cpu, _sublanes(cpu)):
                box(ev.start, ev.end - ev.start, yb + lane * h, h * 0.92, OPT_COLOR, _label(ev, split))
    ax.set_xlim(0, xmax)
    ax.set_ylim(-0.1, top - 0.25)
    ax.set_yticks([yb + h / 2 for _, yb, h in rows])
    ax.set_yticklabels([name for name, _, _ in rows], fontsize=7)
    for name, yb, _ in rows:
        if name.startswith("GPU"):
            ax.axhline(yb - 0.04, color="#dddddd", lw=0.5, zorder=0)
    ax.axvline(tl.iteration, color="#c0392b", lw=0.8, ls="--")
    ax.set_title(title_of(tl), fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _rect(x: float, y: float, w: float, h: float, color: str):
    import matplotlib.patches as mpatches

    return mpatches.Rectangle((x, y), w, h, facecolor=color, edgecolor="#333333", linewidth=0.4)


def draw_compare(timelines: Sequence[Timeline], path: str | Path, *, width: float = 16.0, dpi: int = 130) -> Path:
    """Stack ``timelines`` (one panel each) on one time axis and save a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not timelines:
        raise ValueError("draw_compare needs at least one timeline")
    for tl in timelines:
        if not tl.events:
            raise ValueError(f"timeline {tl.name!r} has no events: simulate it with record=True to draw it")
    xmax = max(tl.iteration for tl in timelines) * 1.02 or 1.0
    heights = []
    for tl in timelines:
        n_cpu = len({e.rank for e in tl.events if e.lane == "cpu"})
        heights.append(0.55 + tl.n_ranks * 0.62 + n_cpu * 0.22)
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(width, sum(heights)),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    px_per_unit = (width * 0.86 * dpi) / xmax
    for ax, tl in zip(axes[:, 0], timelines):
        _panel(ax, tl, xmax, px_per_unit)
    unit = timelines[0].unit
    axes[-1, 0].set_xlabel("time (cost units)" if unit == "units" else "time (s)", fontsize=8)
    fig.subplots_adjust(
        left=0.05,
        right=0.99,
        top=1 - 0.32 / sum(heights),
        bottom=0.45 / sum(heights),
        hspace=0.55 / max(1.0, sum(heights) / len(timelines)),
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def draw(timeline: Timeline, path: str | Path, **kw) -> Path:
    """Save one timeline as a PNG (see the module doc)."""
    return draw_compare([timeline], path, **kw)


def chrome_trace(timelines: Timeline | Sequence[Timeline], path: str | Path) -> Path:
    """Write the events as Chrome trace JSON (open in https://ui.perfetto.dev).

    One process per (timeline, rank), one thread per lane; unit-cost timelines use 1 unit = 1 ms.
    """
    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    lanes = ["gpu", "h2d", "d2h", "p2p", "cpu", "reduce"]
    processes: list[tuple[int, str, list[str]]] = []
    boxes: list[dict] = []
    for n, tl in enumerate(tls):
        scale = 1000.0 if tl.unit == "units" else 1e6
        processes += [(n * 1000 + r, f"{title_of(tl).split('  ')[0]} rank {r}", lanes) for r in range(tl.n_ranks)]
        boxes += [
            {
                "name": str(ev.op),
                "cat": ev.lane,
                "pid": n * 1000 + ev.rank,
                "tid": lanes.index(ev.lane),
                "ts": ev.start * scale,
                "dur": (ev.end - ev.start) * scale,
                "args": {"stage": ev.op.stage, "sub": ev.op.sub, "mb": ev.op.mb, "kind": ev.op.kind.name},
            }
            for ev in tl.events
        ]
    return write_trace(path, processes, boxes)


def write_trace(path: str | Path, processes: Sequence[tuple[int, str, Sequence[str]]], boxes: Sequence[dict]) -> Path:
    """The Chrome trace file itself: ``processes`` as ``(pid, name, lane names)`` (a lane's thread id
    is its position), ``boxes`` as complete (``ph: X``) events with ``name``, ``cat``, ``pid``,
    ``tid``, ``ts`` and ``dur`` in microseconds, and ``args``."""
    events: list[dict] = []
    for pid, name, lanes in processes:
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    events += [{**box, "ph": "X"} for box in boxes]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out

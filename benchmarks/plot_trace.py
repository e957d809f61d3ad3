"""Render one training step of a merged pipeline trace as a Gantt chart (PNG).

    python benchmarks/plot_trace.py TRACE_JSON OUT_PNG [--step N] [--title TEXT]

``TRACE_JSON`` is the merged ``trace.json`` that ``MultiModulePipelineStrategy(trace_dir=...)``
writes (Chrome trace-event format; a per-rank ``trace_rank{r}.json`` works too). One row per
rank (rank 0 on top), time in milliseconds from the step's first event:

* forwards: solid boxes, one colour per module; backwards: the same colour, darker and hatched;
  the microbatch number is written in a box wide enough to hold it;
* ``exchange`` (posting transfers; with blocking exchanges also the wait for a peer) and
  ``wait`` (a compute waiting for a posted receive): light grey;
* receives in flight (track 1 of the trace: from the exchange that posted a receive to the
  moment its consumer has the data): thin bars under the rank's row, forward activations
  above backward gradients; where such a bar runs under a compute box, the transfer overlapped
  that compute;
* ``dp_allreduce`` (gradient sum over a module's replicas): orange;
* ``optimizer_step``: red;
* ``metrics_allreduce`` (the step's loss and metrics, made identical on every rank): dark grey.

``--step`` picks the training step (the ``step`` argument of the events, Lightning's
``global_step``); by default the last one in the file. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import colorsys
import json
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

MODULE_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#e377c2", "#8c564b", "#bcbd22", "#393b79")
COMM_COLOUR = "#c8c8c8"
FORWARD_RECV_COLOUR = "#4d4d4d"
BACKWARD_RECV_COLOUR = "#a05a2c"
RECV_LANE = 0.09  # height of one lane of receives in flight, in rows
DP_COLOUR = "#ff7f0e"
OPTIMIZER_COLOUR = "#d62728"
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
# fill shade and hatch of each backward kind (zero_bubble splits B into input and weight halves)
BACKWARD_STYLE = {"backward": (0.62, "///"), "backward_input": (0.62, "///"), "backward_weight": (0.85, "...")}


def load_trace(path: str) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The complete ("X") events of a trace file and the process names from its metadata."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X"], names


def steps_in(events: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({e.get("args", {}).get("step", 0) for e in events})


def shade(colour: str, factor: float) -> tuple[float, float, float]:
    """``colour`` with its lightness scaled by ``factor`` (< 1 darker, > 1 lighter)."""
    h, lum, s = colorsys.rgb_to_hls(*to_rgb(colour))
    return colorsys.hls_to_rgb(h, max(0.0, min(1.0, lum * factor)), s)


def text_colour(rgb: Sequence[float]) -> str:
    r, g, b = rgb[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def plot_step(events: Sequence[dict[str, Any]], names: dict[int, str], out_png: str, step: int | None = None,
              title: str | None = None) -> dict[str, Any]:
    """Draw ``step`` (default: the last) of ``events`` into ``out_png``; return a short summary."""
    available = steps_in(events)
    if not available:
        raise SystemExit("the trace holds no complete ('X') events")
    step = available[-1] if step is None else step
    if step not in available:
        raise SystemExit(f"step {step} is not in the trace; it holds steps {available}")
    chosen = [e for e in events if e.get("args", {}).get("step", 0) == step]
    t0 = min(e["ts"] for e in chosen)
    t1 = max(e["ts"] + e["dur"] for e in chosen)
    span_ms = (t1 - t0) / 1000.0
    pids = sorted({e["pid"] for e in chosen} | set(names))
    row = {pid: i for i, pid in enumerate(pids)}

    # modules in order of first appearance (by rank, then time) get the palette in order
    modules: list[str] = []
    held: dict[int, list[str]] = {pid: [] for pid in pids}
    for e in sorted(chosen, key=lambda e: (e["pid"], e["ts"])):
        if e["name"] in COMPUTE:
            if e["cat"] not in modules:
                modules.append(e["cat"])
            label = f"{e['cat']} s{e['args']['stage']}" if "stage" in e["args"] else e["cat"]
            if label not in held[e["pid"]]:
                held[e["pid"]].append(label)
    colour = {m: MODULE_COLOURS[i % len(MODULE_COLOURS)] for i, m in enumerate(modules)}

    fig_w = 13.0
    fig_h = 1.2 + 0.55 * len(pids)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    fig.subplots_adjust(left=0.11, right=0.99, top=1 - 0.45 / fig_h, bottom=0.95 / fig_h)
    ax.set_xlim(0, span_ms * 1.005)
    ax.set_ylim(len(pids) - 0.5, -0.5)
    px_per_ms = ax.get_window_extent().width / (span_ms * 1.005)
    fontsize = 7.5
    char_px = fontsize * fig.dpi / 72 * 0.62

    counts = {"forward": 0, "backward": 0, "exchange": 0, "recv": 0, "other": 0}
    in_flight = any(e["name"] == "recv" for e in chosen)
    height = 0.8 - (2 * RECV_LANE + 0.04 if in_flight else 0.0)
    for e in sorted(chosen, key=lambda e: e["name"] in COMPUTE):  # compute drawn last, on top
        x = (e["ts"] - t0) / 1000.0
        w = e["dur"] / 1000.0
        y = row[e["pid"]] - 0.4
        name = e["name"]
        label = None
        if name in COMPUTE:
            base = colour[e["cat"]]
            if name == "forward":
                face = to_rgb(base)
                patch = Rectangle((x, y), w, height, facecolor=face, edgecolor="white", linewidth=0.4)
            else:
                factor, hatch = BACKWARD_STYLE[name]
                face = shade(base, factor)
                patch = Rectangle((x, y), w, height, facecolor=face, edgecolor="white", linewidth=0.4,
                                  hatch=hatch, hatchcolor=shade(base, 1.25))
            label = str(e["args"].get("microbatch", ""))
            counts["forward" if name == "forward" else "backward"] += 1
        elif name == "recv":  # a receive in flight, drawn in a thin lane under the row
            lane = 0 if e["args"].get("direction") == "forward" else 1
            face = to_rgb(FORWARD_RECV_COLOUR if lane == 0 else BACKWARD_RECV_COLOUR)
            patch = Rectangle((x, y + height + 0.02 + lane * RECV_LANE), w, RECV_LANE * 0.8, facecolor=face,
                              edgecolor="white", linewidth=0.3)
            counts["recv"] += 1
        elif name in ("exchange", "wait"):
            face = to_rgb(COMM_COLOUR)
            patch = Rectangle((x, y + 0.15), w, height - 0.3, facecolor=face, linewidth=0)
            counts["exchange" if name == "exchange" else "other"] += 1
        else:
            face = to_rgb(DP_COLOUR if name == "dp_allreduce" else OPTIMIZER_COLOUR if name == "optimizer_step"
                          else "#7f7f7f")
            patch = Rectangle((x, y), w, height, facecolor=face, linewidth=0)
            label = {"dp_allreduce": "dp", "optimizer_step": "opt", "metrics_allreduce": "m"}.get(name, name)
            counts["other"] += 1
        ax.add_patch(patch)
        if label and w * px_per_ms >= char_px * len(label) + 3:
            ax.text(x + w / 2, y + height / 2, label, ha="center", va="center", fontsize=fontsize,
                    color=text_colour(face), fontweight="bold", clip_on=True,
                    bbox=dict(boxstyle="square,pad=0.05", facecolor=face, linewidth=0)
                    if name in BACKWARD_STYLE else None)

    ax.set_yticks(range(len(pids)))
    ax.set_yticklabels([f"{names.get(pid, f'rank {pid}')}\n{', '.join(held[pid])}".rstrip() for pid in pids],
                       fontsize=8.5)
    ax.set_xlabel(f"ms since the first event of step {step}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"step {step}: {span_ms:.1f} ms", fontsize=10, loc="left")

    handles = []
    for m in modules:
        handles.append(Patch(facecolor=colour[m], edgecolor="white", label=f"{m} forward"))
        names_here = {e["name"] for e in chosen if e.get("cat") == m}
        for kind, text in (("backward", "backward"), ("backward_input", "backward I"), ("backward_weight", "backward W")):
            if kind in names_here or (kind == "backward" and not names_here & set(BACKWARD_STYLE)):
                factor, hatch = BACKWARD_STYLE[kind]
                handles.append(Patch(facecolor=shade(colour[m], factor), edgecolor="white", hatch=hatch,
                                     hatchcolor=shade(colour[m], 1.25), label=f"{m} {text}"))
    handles.append(Patch(facecolor=COMM_COLOUR, label="comm (post / wait)"))
    if in_flight:
        handles.append(Patch(facecolor=FORWARD_RECV_COLOUR, label="activation in flight"))
        handles.append(Patch(facecolor=BACKWARD_RECV_COLOUR, label="gradient in flight"))
    names_seen = {e["name"] for e in chosen}
    if "dp_allreduce" in names_seen:
        handles.append(Patch(facecolor=DP_COLOUR, label="dp all-reduce"))
    if "optimizer_step" in names_seen:
        handles.append(Patch(facecolor=OPTIMIZER_COLOUR, label="optimizer step"))
    if "metrics_allreduce" in names_seen:
        handles.append(Patch(facecolor="#7f7f7f", label="metrics all-reduce"))
    axes_h_in = fig_h * (fig.subplotpars.top - fig.subplotpars.bottom)
    ncol = (len(handles) + 1) // 2  # column-major: each module's forward above its backward
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.55 / axes_h_in), ncol=ncol,
              fontsize=7.5, frameon=False, handlelength=1.8, columnspacing=1.5)
    fig.savefig(out_png, bbox_inches="tight")
    plt.close(fig)
    return {"step": step, "span_ms": span_ms, "ranks": len(pids), "modules": modules, **counts}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_json")
    parser.add_argument("out_png")
    parser.add_argument("--step", type=int, default=None, help="training step to draw (default: the last)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    events, names = load_trace(args.trace_json)
    summary = plot_step(events, names, args.out_png, args.step, args.title)
    print(f"wrote {args.out_png}: step {summary['step']}, {summary['span_ms']:.1f} ms, {summary['ranks']} ranks, "
          f"{summary['forward']} forwards, {summary['backward']} backwards, {summary['exchange']} exchanges")


if __name__ == "__main__":
    main()

"""PNG charts of a ``bench compare`` run (matplotlib, Agg: no display needed)."""
from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

from pagellm.bench.compare import DesignResult, SweepPoint

_COLORS = ["tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:green"]


def _save(fig: plt.Figure, path: str) -> str:
    """Writes the chart to ``path`` and frees it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv_timeline(designs: Sequence[DesignResult], path: str) -> str:
    """Utilization, tokens held vs reserved, and requests in flight over time, per design."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for design, color in zip(designs, _COLORS):
        t = [s.time_s for s in design.samples]
        util = [100 * s.utilization if s.utilization is not None else float("nan") for s in design.samples]
        axes[0].plot(t, util, color=color, lw=1, label=design.label)
        axes[1].plot(t, [s.num_held_tokens for s in design.samples], color=color, lw=1, label=f"{design.label}: held")
        axes[1].plot(
            t, [s.num_reserved_tokens for s in design.samples], color=color, lw=1, ls="--", label=f"{design.label}: reserved"
        )
        axes[2].plot(t, [s.num_running for s in design.samples], color=color, lw=1, label=design.label)
    budget = designs[0].kv_budget_tokens
    axes[0].set_ylabel("KV utilization (%)\nheld / reserved")
    axes[0].set_ylim(0, 105)
    axes[1].axhline(budget, color="gray", lw=0.8, ls=":", label="KV budget")
    axes[1].set_ylabel("KV tokens")
    axes[2].set_ylabel("requests in flight")
    axes[2].set_xlabel("time since start (s)")
    axes[0].set_title("KV cache over time, same workload and budget")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def plot_throughput_latency(designs: Sequence[DesignResult], path: str) -> str:
    labels = [d.label for d in designs]
    colors = _COLORS[: len(designs)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [
        ("output throughput (tok/s)", [d.output_throughput for d in designs]),
        ("mean request latency (s)", [d.mean_latency_ms / 1000 for d in designs]),
        ("p99 request latency (s)", [d.p99_latency_ms / 1000 for d in designs]),
    ]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_block_size_sweep(points: Sequence[SweepPoint], path: str) -> str:
    sizes = [p.block_size for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(sizes, [100 * p.mean_wasted_fraction for p in points], "o-", color="tab:red")
    axes[0].set_title("waste in last blocks (% of reserved)")
    axes[1].plot(sizes, [p.mean_block_table_entries for p in points], "o-", color="tab:purple")
    axes[1].set_title("block-table entries per step (mean)")
    axes[2].plot(sizes, [p.output_throughput for p in points], "o-", color="tab:blue")
    axes[2].set_title("output throughput (tok/s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_compare(designs: Sequence[DesignResult], sweep: Sequence[SweepPoint], out_dir: str) -> list[str]:
    """Writes every chart that has data into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        plot_kv_timeline(designs, os.path.join(out_dir, "kv_utilization.png")),
        plot_throughput_latency(designs, os.path.join(out_dir, "throughput_latency.png")),
    ]
    if sweep:
        paths.append(plot_block_size_sweep(sweep, os.path.join(out_dir, "block_size_sweep.png")))
    return paths

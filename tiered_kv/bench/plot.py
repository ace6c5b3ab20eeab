"""``--plot PATH``: the bench's throughput ratios and hit rates as one PNG (needs matplotlib,
the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bench package imports this module for PLOTTED: no schema import cycle
    from tiered_kv.bench.schema import BenchDocument

#: The sections the plot draws, one panel each.
PLOTTED = ("tiers", "workload")


def write_plot(document: BenchDocument, path: Path) -> None:
    """Draw the tiers' ratios to their limits and the workload's hit rates per tier."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'tiered-kv[plot]'") from exc
    panels = [name for name in PLOTTED if getattr(document, name)]
    if not panels:
        raise RuntimeError(f"--plot draws the {' and '.join(PLOTTED)} sections; none of them ran")
    figure, axes = plt.subplots(len(panels), 1, figsize=(11, 4.5 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel == "tiers" and document.tiers:
            labels = [
                f"{f.path}{' (' + f.layout + ')' if f.layout else ''}\n{f.chunk_bytes >> 20} MiB"
                for f in document.tiers
            ]
            ax.bar(range(len(labels)), [f.ratio for f in document.tiers], color="tab:blue")
            ax.axhline(0.8, color="tab:red", linestyle="--", linewidth=1, label="0.80")
            ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel("throughput / this machine's limit")
            ax.set_title("tiers: driver throughput as a fraction of the limit measured in the same run")
            ax.legend()
        elif panel == "workload" and document.workload:
            traces = document.workload.traces
            names = [t.trace for t in traces]
            cpu = [t.hit_rate_cpu for t in traces]
            nvme = [t.hit_rate_nvme for t in traces]
            ax.bar(names, cpu, label="from cpu", color="tab:green")
            ax.bar(names, nvme, bottom=cpu, label="from nvme", color="tab:orange")
            for i, t in enumerate(traces):
                ax.annotate(f"TTFT {t.ttft_speedup:.2f}x", (i, cpu[i] + nvme[i]), ha="center", va="bottom")
            ax.set_ylim(0, 1)
            ax.set_ylabel("chunk hit rate")
            ax.set_title(f"workload: {document.workload.model}")
            ax.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)

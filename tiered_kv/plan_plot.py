"""``tiered-kv plan --plot PATH``: hit rate against capacity as one PNG (needs matplotlib,
the ``plot`` extra): one curve per tiered-kv policy, the peers dotted, MIN dashed, the
compulsory-miss bound as a line."""

from __future__ import annotations

from pathlib import Path

from tiered_kv.planner import Plan


def write_plan_plot(plan: Plan, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'tiered-kv[plot]'") from exc
    figure, ax = plt.subplots(figsize=(8, 5))
    for curve in plan.curves:
        if curve.kind == "optimum":
            style = {"color": "black", "linestyle": "--", "linewidth": 2}
        elif curve.kind == "peer":
            style = {"linestyle": ":", "linewidth": 1.5}
        else:
            style = {"linewidth": 1.5, "marker": "o", "markersize": 3}
        ax.plot(plan.capacities, curve.hit_rates, label=curve.name, **style)  # type: ignore[arg-type]
    ax.axhline(plan.compulsory_hit_rate, color="gray", linewidth=1, label="compulsory-miss bound")
    for sizing in plan.sizings:
        ax.axvline(sizing.chunks, color="tab:red", linewidth=0.8, alpha=0.6)
        ax.annotate(f"{sizing.tier} {sizing.chunks:,}", (sizing.chunks, 0.02), rotation=90, fontsize=7, color="tab:red")
    ax.set_xscale("log")
    ax.set_xlabel(f"capacity (chunks of {plan.chunk_tokens} tokens)")
    ax.set_ylabel("chunk hit rate (prefix semantics)")
    ax.set_ylim(0, min(1.0, plan.compulsory_hit_rate * 1.1 + 0.02))
    ax.set_title(f"tiered-kv plan: {plan.trace} ({plan.requests:,} requests, {plan.working_set_chunks:,} chunks)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90, format="png")
    plt.close(figure)

"""The throughput plot of a bench.run run (throughput.png): images/s per configuration and row."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> None:
    """Grouped bars of images/s per configuration, one bar per row, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results["rows"] if r["status"] == "ok"]
    labels = sorted(
        {
            r["spec"]["row"] + ("" if r["spec"]["input"] == "synthetic" else "+" + r["spec"]["input"])
            for r in ok
        }
    )
    configs = list(
        dict.fromkeys(
            f"{r['spec']['model']}\nbatch {r['spec']['batch']}, {r['spec']['image_size']} px" for r in ok
        )
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(configs) * max(1, len(labels)) / 3), 4.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for r in ok:
            s = r["spec"]
            if s["row"] + ("" if s["input"] == "synthetic" else "+" + s["input"]) != label:
                continue
            ips = r["images_per_s"]
            xs.append(
                configs.index(f"{s['model']}\nbatch {s['batch']}, {s['image_size']} px")
                + (i - (len(labels) - 1) / 2) * width
            )
            ys.append(ips["median"])
            lo.append(ips["median"] - ips["min"])
            hi.append(ips["max"] - ips["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"({label})")
    ax.set_xticks(range(len(configs)), configs, fontsize=8)
    ax.set_ylabel("images/s (median, min-max)")
    env = results["environment"]
    ax.set_title(
        f"fasttrain training throughput, {env.get('gpu') or 'CPU'}, {env['date'][:10]}"
        + (" (smoke)" if results["smoke"] else ""),
        fontsize=10,
    )
    if ax.get_legend_handles_labels()[0]:  # nothing measured (every row skipped): no legend
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

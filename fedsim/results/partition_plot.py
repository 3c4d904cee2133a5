"""The figure of a run's split, as a paper shows it: a histogram of the clients' training sizes beside the label
proportions of up to MAX_BARS clients (evenly spaced ids when there are more, the count said in the panel's title),
the heterogeneity numbers in the figure's title and the classes' legend beside the panels, never over them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim.errors import FedsimError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fedsim.persist.storage import StorePath
    from fedsim.results.partition_report import PartitionReport

MAX_BARS = 50
LEGEND_CLASSES = 20  # up to this many classes get a legend entry each; more, a colorbar of class ids
PANEL_INCHES = (4.8, 3.6)


def shown_clients(num_clients: int, most: int = MAX_BARS) -> np.ndarray:
    """The client ids a figure draws: all of them, or `most` evenly spaced from the first to the last."""
    if num_clients <= most:
        return np.arange(num_clients)
    return np.unique(np.linspace(0, num_clients - 1, most).round().astype(np.int64))


def heterogeneity_line(stats: dict[str, Any]) -> str:
    """The report's numbers in one line: TV distance to the pooled labels, classes per client, size spread."""
    parts = []
    if stats.get("tv_mean") is not None:
        parts.append(f"TV to pooled labels {stats['tv_mean']:.2f} (p10 {stats['tv_p10']:.2f}, "
                     f"p90 {stats['tv_p90']:.2f})")
        parts.append(f"{stats['classes_per_client_mean']:.1f} of {stats['classes']} classes per client")
    else:
        why = str(stats.get("labels", "")).partition(": ")[2]
        parts.append("label histograms not recorded" + (f" ({why})" if why else ""))
    if stats.get("size_cv") is not None:
        parts.append(f"size CV {stats['size_cv']:.2f}, Gini {stats['size_gini']:.2f}")
    return " · ".join(parts)


def partition_figure(report: PartitionReport, title: str | None = None, most: int = MAX_BARS) -> Figure:
    """The figure of `report`: client sizes, then (when recorded) the label proportions of the clients
    `shown_clients` picks, stacked one bar per client; one legend (or colorbar) right of the panels."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    stats, sizes = report.stats, report.clients["train"].to_numpy()
    labelled = report.labels is not None
    fig = Figure(figsize=(PANEL_INCHES[0] * (2.8 if labelled else 1), PANEL_INCHES[1]), layout="constrained")
    axes = fig.subplots(1, 2 if labelled else 1, squeeze=False, width_ratios=[1, 2.2] if labelled else [1]).ravel()
    _sizes_panel(axes[0], sizes)
    name = title if title is not None else "partition"
    fig.suptitle(f"{name}: {stats['clients']:,} clients, {stats['train_samples']:,} training samples\n"
                 f"{heterogeneity_line(stats)}", fontsize="medium")
    if not labelled:
        return fig
    ax, classes = axes[1], int(stats["classes"])
    ids = shown_clients(len(sizes), most)
    shares = _shares(report, ids, classes)
    if classes <= LEGEND_CLASSES:
        cmap = matplotlib.colormaps["tab10" if classes <= 10 else "tab20"]
        colors = [cmap(c) for c in range(classes)]
    else:
        cmap = matplotlib.colormaps["viridis"]
        colors = [cmap(c / (classes - 1)) for c in range(classes)]
    x = np.arange(len(ids))
    ax.add_collection(_stacked_bars(shares, np.asarray(colors)))
    ax.set_xlim(-0.6, len(ids) - 0.4)
    ax.set_ylim(0, 1)
    step = max(1, -(-len(ids) // 12))  # at most a dozen id labels
    ax.set_xticks(x[::step], [str(i) for i in ids[::step]])
    ax.set_xlabel("client id")
    ax.set_ylabel("share of its training samples")
    shown = f"all {len(ids)} clients" if len(ids) == len(sizes) else \
        f"{len(ids)} of {len(sizes):,} clients (evenly spaced ids)"
    ax.set_title(f"label proportions, {shown}", fontsize="medium")
    if classes <= LEGEND_CLASSES:
        handles = [Patch(color=colors[c], label=str(c)) for c in range(classes)]
        fig.legend(handles=handles, loc="outside right upper", fontsize="small", title="class")
    else:
        mappable = matplotlib.cm.ScalarMappable(norm=matplotlib.colors.Normalize(0, classes - 1), cmap=cmap)
        fig.colorbar(mappable, ax=list(axes), location="right", label="class", fraction=0.04, pad=0.02)
    return fig


def _stacked_bars(shares: np.ndarray, colors: np.ndarray, width: float = 0.85) -> Any:
    """One bar per row of `shares` (at x = its row), its classes stacked in order, as one collection of rectangles
    (a patch per rectangle took 3 ms each to lay out: 1.5 s for 50 clients × 10 classes)."""
    from matplotlib.collections import PolyCollection

    row, cls = np.nonzero(shares)
    top = np.cumsum(shares, axis=1)[row, cls]
    low = top - shares[row, cls]
    left, right = row - width / 2, row + width / 2
    verts = np.stack([np.stack([left, low], 1), np.stack([right, low], 1), np.stack([right, top], 1),
                      np.stack([left, top], 1)], axis=1)
    return PolyCollection(list(verts), facecolors=colors[cls], linewidths=0)


def _sizes_panel(ax: Any, sizes: np.ndarray) -> None:
    """A histogram of the clients' training sizes (log-spaced bins when they span more than two decades)."""
    from matplotlib.ticker import MaxNLocator

    held = sizes[sizes > 0]
    lo, hi = (int(held.min()), int(held.max())) if len(held) else (0, 1)
    if len(held) and hi > 100 * lo:
        bins: Any = np.geomspace(lo, hi + 1, 40)
        ax.set_xscale("log")
    else:
        bins = int(min(40, max(5, np.ceil(2 * np.sqrt(len(sizes)))), max(1, hi - lo + 1)))
    counts, edges = np.histogram(sizes, bins=bins)
    ax.stairs(counts, edges, fill=True, color="0.35")
    ax.axvline(float(sizes.mean()) if len(sizes) else 0.0, color="C3", linestyle="--", linewidth=1)
    ax.set_xlabel("training samples per client (dashed: mean)")
    ax.set_ylabel("clients")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("client sizes", fontsize="medium")
    ax.grid(alpha=0.3)


def _shares(report: PartitionReport, ids: np.ndarray, classes: int) -> np.ndarray:
    """The training label proportions of clients `ids` (rows; a client without training samples is all zero)."""
    assert report.labels is not None
    labels = report.labels
    rows = labels[(labels["split"] == "train") & labels["client"].isin(ids)]
    counts = np.zeros((len(ids), classes))
    where = np.searchsorted(ids, rows["client"].to_numpy())
    np.add.at(counts, (where, rows["label"].to_numpy()), rows["count"].to_numpy())
    total = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


def plot_partition(path: str | Path | StorePath, out: str | Path | None = None, title: str | None = None) -> Path:
    """Draw the partition report of the run at `path` (fedsim.partition_report) to a PNG: RUN/partition.png by
    default (`<run>-partition.png` here for a run kept in a store); returns its path. A folder that is no run, or a
    run without a report, is a one-line error."""
    from fedsim.persist.io import atomic_write
    from fedsim.results.partition_report import partition_report, report_folder
    from fedsim.results.plots import check_out, check_title_out

    check_title_out(title, out)
    run = report_folder(path)
    report = partition_report(run)
    if out is not None:
        target = Path(out)
    else:
        target = run / "partition.png" if isinstance(run, Path) else Path(f"{run.name}-partition.png")
        check_out(target)
    fig = partition_figure(report, run.name if title is None else title)
    try:
        atomic_write(target, lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight", format="png"))
    except OSError as exc:
        raise FedsimError(f"{'--out ' if out else ''}{target}: cannot write the plot there "
                          f"({exc.strerror or type(exc).__name__})") from None
    return target

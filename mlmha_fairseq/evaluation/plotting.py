"""PNG figures for the analyses (matplotlib, Agg backend, small files)."""
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from mlmha_fairseq.output_files import atomic_output

DPI = 100
BAR_GROUP_WIDTH = 0.8
HEATMAP_CELL_INCHES = 0.45
MIN_HEATMAP_INCHES = 2.5
LINE_FIGSIZE = (8, 3.2)
BAR_FIGSIZE = (7, 3.5)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: str) -> None:
    """Write ``figure`` as a PNG (creating its folder) and close it."""
    figure.tight_layout()
    try:
        with atomic_output(path) as temporary:
            figure.savefig(temporary, dpi=DPI)
    finally:
        pyplot().close(figure)


def _grouped_bars(axis, categories: Sequence[str], series: Dict[str, Sequence[float]]) -> None:
    width = BAR_GROUP_WIDTH / max(len(series), 1)
    positions = np.arange(len(categories))
    for index, (name, values) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        axis.bar(positions + offset, values, width, label=name)
    axis.set_xticks(positions)
    axis.set_xticklabels(categories)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_length_buckets(rows: Sequence[Dict], systems: Sequence[str], metric: str, unit: str,
                        path: str) -> None:
    """Grouped bars: score per source-length bucket and system, counts under the labels."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=BAR_FIGSIZE)
    labels = [f"{row['bucket']}\nn={row['count']}" for row in rows]
    _grouped_bars(axis, labels, {name: [row[name] for row in rows] for name in systems})
    axis.set_xlabel(f"source length ({unit}s)")
    axis.set_ylabel(metric)
    save_figure(figure, path)


def plot_significance(names: Sequence[str], scores: Sequence[float],
                      intervals: Sequence[Optional[Tuple[float, float]]],
                      marks: Sequence[str], metric: str, method: str, path: str) -> None:
    """Each system's score with its 95% resampling interval and significance mark; the
    first system is the baseline (dashed line).

    The interval is drawn from its own bounds, not as error bars around the score: a
    bootstrap interval need not contain the full test set's score (sacreBLEU's is centred
    on the resampled mean), and error bars cannot be negative."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=BAR_FIGSIZE)
    for position, (score, interval, mark) in enumerate(zip(scores, intervals, marks)):
        if interval is not None:
            axis.plot([position, position], interval, marker="_", markersize=12, color="tab:blue")
        axis.plot(position, score, "o", color="tab:blue")
        axis.annotate(f"{score:.2f}{mark}", (position, score), textcoords="offset points",
                      xytext=(8, 0), va="center")
    axis.axhline(scores[0], linestyle="--", color="grey")
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names)
    axis.set_xlim(-0.5, len(names) - 0.2)
    axis.set_ylabel(metric)
    axis.set_title(f"{method}: † p<0.05, ‡ p<0.01 vs {names[0]}", fontsize="medium")
    save_figure(figure, path)


def plot_attention_heatmaps(models: Sequence[Tuple[str, np.ndarray, np.ndarray]],
                            path: str) -> None:
    """Per model, layer x head heat maps of mean distance and entropy."""
    plt = pyplot()
    layers, heads = models[0][1].shape
    cell_w = max(MIN_HEATMAP_INCHES, heads * HEATMAP_CELL_INCHES)
    cell_h = max(MIN_HEATMAP_INCHES, layers * HEATMAP_CELL_INCHES)
    figure, axes = plt.subplots(len(models), 2, figsize=(2 * cell_w + 1.5, len(models) * cell_h),
                                squeeze=False)
    for row, (name, distance, entropy) in enumerate(models):
        for column, (values, title) in enumerate(((distance, "mean distance"), (entropy, "entropy"))):
            axis = axes[row][column]
            image = axis.imshow(values, cmap="viridis", aspect="auto")
            axis.set_xticks(range(heads))
            axis.set_xticklabels(range(1, heads + 1))
            axis.set_yticks(range(layers))
            axis.set_yticklabels(range(1, layers + 1))
            axis.set_xlabel("head")
            axis.set_ylabel("layer")
            axis.set_title(f"{name}: {title}", fontsize="medium")
            figure.colorbar(image, ax=axis)
    save_figure(figure, path)


def plot_attention_layers(models: Sequence[Tuple[str, np.ndarray, np.ndarray]], path: str) -> None:
    """Per-layer averages over heads (Eqs. 14 and 16) for each model."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=LINE_FIGSIZE)
    for name, distance, entropy in models:
        layers = np.arange(1, distance.shape[0] + 1)
        axes[0].plot(layers, distance.mean(axis=1), marker="o", label=name)
        axes[1].plot(layers, entropy.mean(axis=1), marker="o", label=name)
    for axis, title in zip(axes, ("mean distance", "entropy")):
        axis.set_xticks(np.arange(1, models[0][1].shape[0] + 1))
        axis.set_xlabel("encoder layer")
        axis.set_title(title, fontsize="medium")
        axis.legend(fontsize="small")
    save_figure(figure, path)


def plot_probing(tasks: Sequence[str], accuracies: Dict[str, Sequence[float]], path: str) -> None:
    """Grouped bars: test accuracy (%) per probing task and model."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=BAR_FIGSIZE)
    _grouped_bars(axis, tasks, accuracies)
    axis.set_ylabel("test accuracy (%)")
    save_figure(figure, path)


def plot_training_curves(runs: Dict[str, Dict[str, Sequence[Tuple[float, float]]]], stat: str,
                         x_label: str, path: str) -> None:
    """``stat`` against ``x_label`` (updates or epochs), one line per run and split: training
    dashed, validation solid (as the MLRF paper's Figure 4)."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=LINE_FIGSIZE)
    for index, (name, curves) in enumerate(runs.items()):
        color = f"C{index}"
        for split, style in (("train", "--"), ("valid", "-")):
            if curves.get(split):
                xs, values = zip(*curves[split])
                axis.plot(xs, values, style, color=color, label=f"{name} ({split})")
    axis.set_xlabel(x_label)
    axis.set_ylabel(stat)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(figure, path)


def plot_replicates(names: Sequence[str], per_seed: Sequence[Sequence[float]], metric: str, title: str,
                    path: str) -> None:
    """Each system's per-seed scores as dots, with their mean and standard deviation, so that
    the seed-to-seed spread is visible; the first system is the baseline (dashed line)."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=BAR_FIGSIZE)
    for position, values in enumerate(per_seed):
        values = np.asarray(values, dtype=np.float64)
        spread = values.std(ddof=1) if len(values) > 1 else 0.0
        axis.errorbar(position + 0.15, values.mean(), yerr=spread, fmt="s", capsize=4, color="tab:orange",
                      label="mean ± sd" if position == 0 else None)
        axis.scatter(np.full(len(values), position - 0.1), values, color="tab:blue", zorder=3,
                     label="one seed" if position == 0 else None)
    axis.axhline(np.mean(per_seed[0]), linestyle="--", color="grey")
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names, rotation=20, ha="right")
    axis.set_xlim(-0.5, len(names) - 0.5)
    axis.set_ylabel(metric)
    if title:
        axis.set_title(title, fontsize="medium")
    axis.legend(fontsize="small")
    save_figure(figure, path)


def plot_learning_curves(systems: Dict[str, Dict[int, Dict[str, Sequence[Tuple[float, float]]]]],
                         stats: Sequence[Tuple[str, str]], path: str) -> None:
    """One panel per ``(stat, label)`` (e.g. validation BLEU and loss) against updates: per
    system the mean over its seeds (solid), the seed band (mean ± sd over the seeds that
    reached that update) and an ``x`` where each seed stopped."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(stats), figsize=(LINE_FIGSIZE[0] * len(stats) / 1.4, LINE_FIGSIZE[1] + 0.6))
    for axis, (stat, label) in zip(np.atleast_1d(axes), stats):
        for index, (name, seeds) in enumerate(systems.items()):
            points: Dict[float, list] = {}
            for curves in seeds.values():
                for update, value in curves.get(stat, ()):
                    points.setdefault(update, []).append(value)
                if curves.get(stat):
                    axis.plot(*curves[stat][-1], "x", color=f"C{index}")
            if not points:
                continue
            updates = sorted(points)
            mean = np.array([np.mean(points[u]) for u in updates])
            spread = np.array([np.std(points[u], ddof=1) if len(points[u]) > 1 else 0.0 for u in updates])
            axis.plot(updates, mean, color=f"C{index}", label=f"{name} ({len(seeds)} seeds)")
            axis.fill_between(updates, mean - spread, mean + spread, color=f"C{index}", alpha=0.2)
        axis.set_xlabel("updates")
        axis.set_ylabel(label)
    np.atleast_1d(axes)[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(figure, path)

"""Learning curves of a grid trained with ``[convergence]``: validation BLEU and loss of every
run against updates (from fairseq-train's own JSON log), the update at which each seed stopped,
and the systems compared at matched updates.

The comparison at matched updates answers "is system X better at the same training cost?"
where the final checkpoints of runs that stopped at different updates do not: it takes the
last validation that every run of the grid reached and reports each system's mean ± sd of
validation BLEU there.
"""
import re
from typing import Dict, List, Optional, Tuple

from mlmha_fairseq.evaluation.plotting import plot_learning_curves
from mlmha_fairseq.evaluation.replicates import mean_sd_text
from mlmha_fairseq.evaluation.text_io import InputError, write_json, write_text
from mlmha_fairseq.evaluation.training_curves import read_log_curves
from mlmha_fairseq.experiments.grid import (
    CONVERGED, Grid, Run, Settings, best_point, failure_line, last_update, log_text, validations_since_best)

STATS = (("bleu", "validation BLEU"), ("loss", "validation loss"))
Curve = List[Tuple[float, float]]
# fairseq-train's own log lines for why it stopped; a resumed run's log holds its attempts in
# order, so the last one found is the run's
STOPS = (("early stop since valid performance hasn't improved", "patience"),
         (CONVERGED, "patience (over the attempts, counted by the runner)"),
         ("Stopping training due to num_updates", "max_update"),
         ("Stopping training due to cumulative_training_time", "time limit (--stop-time-hours)"),
         ("Traceback (most recent call last)", "failed"))
NOT_STOPPED = "not stopped (training, or killed)"


# the stop of an attempt trained to a lower cap (the runner's --max-update, given once) is not
# the run's when a later attempt resumes it with a higher one
BOUNDED_ATTEMPT = re.compile(r"Stopping training due to num_updates: \d+ >= max_update: (\d+)")


def stop_reason(log_path: str, max_update: int) -> str:
    """Why a run's fairseq-train stopped: ``patience``, ``max_update`` (the run's cap, not an
    earlier attempt's lower one), the time limit, or ``failed: <error>``; :data:`NOT_STOPPED` when its log
    records no stop."""
    text = log_text(log_path)
    for bound in reversed(list(BOUNDED_ATTEMPT.finditer(text))):
        if int(bound.group(1)) < max_update:
            text = text[:bound.start()] + text[bound.end():]
    found = max(((text.rfind(marker), reason) for marker, reason in STOPS), default=(-1, ""))
    if found[0] < 0:
        return NOT_STOPPED
    return f"failed: {failure_line(text)}" if found[1] == "failed" else found[1]


def run_stop(run: Run, settings: Settings) -> str:
    """:func:`stop_reason` of a run; a finished run whose log records no stop but shows the
    patience spent was stopped by the runner before it wrote CONVERGED into logs (earlier
    versions)."""
    log = run.path("logs", "train.log")
    reason = stop_reason(log, settings.max_update)
    if (reason == NOT_STOPPED and run.finished and settings.stops_early
            and validations_since_best(log, metric=settings.convergence.metric) >= settings.convergence.patience):
        return dict(STOPS)[CONVERGED]
    return reason


def run_curves(run: Run) -> Dict[str, Curve]:
    """``{"bleu": [(update, value), ...], "loss": [...]}`` of one run's validations (empty
    lists before its first validation)."""
    curves = {}
    for stat, _ in STATS:
        try:
            curves[stat] = read_log_curves(run.path("logs", "train.log"), stat)["valid"]
        except InputError:  # no log yet, or no validation logged yet
            curves[stat] = []
    return curves


def matched_update(curves: Dict[str, Dict[int, Dict[str, Curve]]]) -> Optional[float]:
    """The last update at which every run with a curve was validated (None: no common one)."""
    common = None
    for seeds in curves.values():
        for run in seeds.values():
            updates = {update for update, _ in run["bleu"]}
            common = updates if common is None else common & updates
    return max(common) if common else None


def curve_report(grid: Grid) -> Dict:
    """Per system and seed: where the run stopped, its best validation BLEU and its lowest
    validation loss and when (the earlier of equal ones; with ``metric = "loss"`` the lowest
    loss's is the decoded checkpoint); the systems at the matched update."""
    curves: Dict[str, Dict[int, Dict[str, Curve]]] = {}
    for run in grid.runs:
        run_curve = run_curves(run)
        if run_curve["bleu"]:
            curves.setdefault(run.system.name, {})[run.seed] = run_curve
    seeds = {}
    for name, runs in curves.items():
        seeds[name] = {}
        for seed, run_curve in runs.items():
            best_update, best = best_point(run_curve["bleu"], "bleu")
            lowest_update, lowest = best_point(run_curve["loss"], "loss")
            run = next(r for r in grid.runs if r.system.name == name and r.seed == seed)
            log = run.path("logs", "train.log")
            stopped_by = run_stop(run, grid.settings)
            # stopped by patience: at its last validation, whose checkpoint is the last one (the
            # runner's stop may come a few updates after it, which are not kept)
            stopped_at = int(run_curve["bleu"][-1][0]) if stopped_by.startswith("patience") else last_update(log)
            seeds[name][seed] = {"stopped_at": stopped_at, "stopped_by": stopped_by,
                                 "finished": run.finished, "best_bleu": best, "best_update": best_update,
                                 "lowest_loss": lowest, "lowest_loss_update": lowest_update,
                                 "validations": len(run_curve["bleu"])}
    update = matched_update(curves)
    matched = {name: [dict(run["bleu"])[update] for run in runs.values()] for name, runs in curves.items()
               } if update is not None else {}
    return {"curves": curves, "seeds": seeds, "matched_update": update, "matched_bleu": matched}


CURVE_REPORT_EXTENSIONS = (".md", ".json", ".png")  # what write_curve_report writes


def write_curve_report(grid: Grid, prefix: str) -> str:
    """``<prefix>.png`` (the curves), ``<prefix>.json`` and ``<prefix>.md``; returns the Markdown."""
    report = curve_report(grid)
    if not report["curves"]:
        return ""
    plot_learning_curves(report["curves"], STATS, prefix + ".png")
    lines = ["| system | seed | stopped at update | stopped by | finished | best validation BLEU | at update "
             "| lowest validation loss | at update | validations |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, seeds in report["seeds"].items():
        for seed, row in sorted(seeds.items()):
            lines.append(f"| {name} | {seed} | {row['stopped_at']} | {row['stopped_by']} | "
                         f"{'yes' if row['finished'] else 'no'} | "
                         f"{row['best_bleu']:.2f} | {row['best_update']:.0f} | "
                         f"{row['lowest_loss']:.3f} | {row['lowest_loss_update']:.0f} | {row['validations']} |")
    if report["matched_update"] is not None:
        lines += ["", f"Validation BLEU at update {report['matched_update']:.0f}, the last that every run reached "
                      "(mean ± sd over seeds):", "", "| system | validation BLEU | seeds |", "|---|---|---|"]
        lines += [f"| {name} | {mean_sd_text(values)} | {len(values)} |" for name, values in report["matched_bleu"].items()]
    text = "\n".join(lines) + "\n"
    write_text(prefix + ".md", text)
    write_json(prefix + ".json", {key: report[key] for key in ("seeds", "matched_update", "matched_bleu", "curves")})
    return text

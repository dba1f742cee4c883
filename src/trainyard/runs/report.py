"""Plots and a short markdown summary of one or more runs, from metrics.jsonl and summary.json.

Several runs share each figure, one colour per run, so a change shows up side by side. A run
without summary.json (crashed, or still running) is reported from metrics.jsonl and env.json, with
the events that help find the fault: non-finite losses, skipped steps, the last checkpoint.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from trainyard.errors import RunDirError
from trainyard.runs import layout as run_layout

GIB = 1024**3
DEFAULT_MULTI_RUN_OUT = "trainyard-report"
SAMPLES_SHOWN = 5
"""Generations of the last evaluation shown per run: enough to see what the model answers."""
SAMPLE_CHARS = 80


@dataclass
class Run:
    name: str
    path: Path
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    env: dict[str, Any]
    bad_lines: int


@dataclass(frozen=True)
class Line:
    kind: str
    field: str
    label: str
    style: str
    scale: float = 1.0


@dataclass(frozen=True)
class Plot:
    file: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    marks: str = ""
    """A system event drawn as a dotted vertical line at its step, in the run's colour."""


PLOTS = (
    Plot("loss.png", "loss", "loss", (Line("train", "loss", "train", "-"), Line("eval", "eval_loss", "eval", "--o"))),
    Plot(
        "tokens_per_s.png", "throughput (real tokens, all ranks)", "tokens/s", (Line("train", "tokens_per_s", "", "-"),)
    ),
    Plot("peak_memory.png", "memory per step, highest rank (dotted: a memory_growth alarm)",
         "GiB (CPU: RSS; CUDA: peak per log window)", (Line("train", "peak_memory_bytes", "", "-", 1 / GIB),),
         "memory_growth"),
    Plot("lr.png", "learning rate", "lr", (Line("train", "lr", "", "-"),)),
    Plot("grad_norm.png", "gradient norm (before clipping)", "grad norm", (Line("train", "grad_norm", "", "-"),)),
    Plot("router_aux_loss.png", "MoE router auxiliary (load-balancing) loss", "aux loss",
         (Line("train", "router_aux_loss", "", "-"),)),
)


def _train_and_eval(name: str, label: str = "", styles: tuple[str, str] = ("-", "--o")) -> tuple[Line, Line]:
    """A figure as train events carry it and as eval events do (`eval_` before its name)."""
    return (Line("train", name, f"train {label}".strip(), styles[0]),
            Line("eval", f"eval_{name}", f"eval {label}".strip(), styles[1]))


def _chosen_and_rejected(group: str) -> tuple[Line, ...]:
    """The chosen answers' figure (solid; eval dashed with dots) and the rejected ones' (dotted; eval with crosses)."""
    rejected = _train_and_eval(f"{group}/rejected", "rejected", (":", "--x"))
    return (*_train_and_eval(f"{group}/chosen", "chosen"), *rejected)


OBJECTIVE_PLOTS = {
    "dpo": (
        Plot("dpo_margins.png", "DPO reward margin (chosen - rejected: rises as the policy learns the preference)",
             "reward margin", _train_and_eval("rewards/margins")),
        Plot("dpo_accuracies.png", "DPO reward accuracy (pairs whose chosen answer out-rewards the rejected one)",
             "share of pairs", _train_and_eval("rewards/accuracies")),
        Plot("dpo_rewards.png", "DPO rewards of the chosen and the rejected answers", "reward",
             _chosen_and_rejected("rewards")),
        Plot("dpo_logps.png", "DPO policy log-probabilities (both falling: the chosen answers are unlearnt too)",
             "log-probability", _chosen_and_rejected("logps")),
    ),
}
"""Each objective's own figures (runs.layout.OBJECTIVE_FIGURES), drawn for the runs that logged them."""
ALL_PLOTS = (*PLOTS, *(plot for plots in OBJECTIVE_PLOTS.values() for plot in plots))


# ---------------------------------------------------------------- reading


def load_run(run_dir: Path) -> Run:
    metrics = run_dir / run_layout.METRICS
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} does not exist", fix="pass a run's folder: <output_dir>/<run_name>")
    if not metrics.is_file():
        raise RunDirError(
            f"{metrics} is missing", fix="pass a run dir written by `trainyard train` (it holds metrics.jsonl)"
        )
    events, bad = read_events(metrics)
    if not events:
        raise RunDirError(f"{metrics} has no events yet", fix="wait for the first logged step, or pass another run dir")
    env = read_json(run_dir / run_layout.ENV) or {}
    return Run(run_dir.name, run_dir, events, read_json(run_dir / run_layout.SUMMARY), env, bad)


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every JSON object line; a line cut short by a killed run is counted, not fatal."""
    events, bad = [], 0
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():  # garbled bytes: a bad line
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(event, dict):
            events.append(event)
        else:
            bad += 1
    return events, bad


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    fix = "remove the broken file; the report then uses metrics.jsonl"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as err:
        raise RunDirError(f"{path} is not valid JSON ({err.msg}, line {err.lineno})", fix=fix) from None
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not UTF-8 text", fix=fix) from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path} is not a JSON object", fix=fix)
    return data


def load_runs(run_dirs: list[Path]) -> list[Run]:
    runs = [load_run(Path(d)) for d in run_dirs]
    names = Counter(run.name for run in runs)
    for run in runs:
        if names[run.name] > 1:  # two output dirs with the same run_name
            run.name = f"{run.path.parent.name}/{run.name}"
    return runs


def series(events: list[dict[str, Any]], kind: str, field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one field; a resumed run logs some steps twice and the last one wins."""
    by_step: dict[int, float] = {}
    for event in events:
        value = event.get(field)
        if event.get("kind") == kind and "step" in event and isinstance(value, int | float):
            by_step[int(event["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


# ---------------------------------------------------------------- plots


def draw(runs: list[Run], plot: Plot, out: Path) -> Path | None:
    """One PNG with a line per run (and per kind); None when no run logged that metric."""
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    drawn = 0
    for index, run in enumerate(runs):
        for line in plot.lines:
            steps, values = series(run.events, line.kind, line.field)
            if not steps:
                continue
            label = f"{run.name} {line.label}".strip()
            axes.plot(
                steps, [v * line.scale for v in values], line.style, color=f"C{index % 10}", label=label, markersize=4
            )
            drawn += 1
        for step in (e["step"] for e in run.events if plot.marks and e.get("event") == plot.marks and "step" in e):
            axes.axvline(step, color=f"C{index % 10}", linestyle=":", linewidth=1.5)
    if not drawn:
        return None
    axes.set_title(plot.title)
    axes.set_xlabel("step")
    axes.set_ylabel(plot.ylabel)
    axes.grid(alpha=0.3)
    axes.legend()
    path = out / plot.file
    figure.savefig(path, format="png")
    return path


# ---------------------------------------------------------------- summary


def run_facts(run: Run) -> dict[str, Any]:
    """Final figures from summary.json, else derived from the metrics of an unfinished run."""
    train_steps, losses = series(run.events, "train", "loss")
    _, speeds = series(run.events, "train", "tokens_per_s")
    _, eval_losses = series(run.events, "eval", "eval_loss")
    _, accuracies = series(run.events, "eval", "eval_accuracy")
    times = [e["time"] for e in run.events if isinstance(e.get("time"), int | float)]
    derived = {
        "steps": train_steps[-1] if train_steps else None,
        "first_train_loss": losses[0] if losses else None,
        "final_train_loss": losses[-1] if losses else None,
        "final_eval_loss": eval_losses[-1] if eval_losses else None,
        "final_eval_accuracy": accuracies[-1] if accuracies else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "wall_time_s": max(times) - min(times) if len(times) > 1 else None,
        "world_size": run.env.get("world_size"),
    }
    summary = run.summary or {}
    facts = {key: value if summary.get(key) is None else summary[key] for key, value in derived.items()}
    facts["status"] = "finished" if run.summary is not None else "no summary.json (crashed or running)"
    return facts


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs} s"


def summary_table(runs: list[Run]) -> list[str]:
    columns = ["run", "status", "world size", "steps", "first loss", "final loss", "eval loss", "eval accuracy"]
    header = "| " + " | ".join([*columns, "tokens/s", "wall time"]) + " |"
    rows = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for run in runs:
        f = run_facts(run)
        cells = [
            run.name,
            f["status"],
            _fmt(f["world_size"], "d"),
            _fmt(f["steps"], "d"),
            _fmt(f["first_train_loss"], ".4f"),
            _fmt(f["final_train_loss"], ".4f"),
            _fmt(f["final_eval_loss"], ".4f"),
            _fmt(f["final_eval_accuracy"], ".1%"),
            _fmt(f["tokens_per_s"], ",.0f"),
            _duration(f["wall_time_s"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def notable_events(run: Run) -> list[str]:
    """What helps find a fault: non-finite losses, system events, checkpoints, unreadable lines."""
    notes = []
    # Non-finite numbers are written as null (older runs wrote a bare NaN); the last event of a step wins.
    losses = {int(e["step"]): e.get("loss") for e in run.events if e.get("kind") == "train" and "step" in e}
    bad_steps = sorted(s for s, v in losses.items() if not (isinstance(v, int | float) and math.isfinite(v)))
    if bad_steps:
        notes.append(f"non-finite train loss first at step {bad_steps[0]} ({len(bad_steps)} logged steps)")
    system = Counter(str(e.get("event", "system")) for e in run.events if e.get("kind") == "system")
    notes += [f"system event `{name}` x{count}" for name, count in sorted(system.items())]
    notes += memory_notes(run)
    checkpoints = [e.get("step") for e in run.events if e.get("kind") == "checkpoint"]
    if checkpoints:
        notes.append(f"{len(checkpoints)} checkpoint(s), last at step {checkpoints[-1]}")
    if run.bad_lines:
        notes.append(f"{run.bad_lines} unreadable line(s) in metrics.jsonl skipped")
    return notes


def memory_notes(run: Run) -> list[str]:
    """The first and the latest memory_growth alarm: when the rise began to show and how fast it goes now."""
    alarms = [e for e in run.events if e.get("kind") == "system" and e.get("event") == "memory_growth"]
    if not alarms:
        return []
    last = alarms[-1]
    runs_out = f", runs out near step {last['runs_out_at_step']}" if last.get("runs_out_at_step") else ""
    return [f"memory grew steadily from step {alarms[0].get('step')} on: {_fmt(last.get('bytes_per_step'), ',.0f')} "
            f"bytes per step on rank(s) {last.get('ranks')} at step {last.get('step')}{runs_out}"]


def last_samples(run: Run) -> tuple[Path, list[dict[str, Any]]] | None:
    """The last evaluation's generations (samples/step-XXXXXXXX.jsonl; rank-<r>.jsonl are data audits)."""
    files = sorted((run.path / run_layout.SAMPLES).glob("step-*.jsonl"))
    return (files[-1], read_events(files[-1])[0]) if files else None


def _cell(value: Any) -> str:
    """A table cell: one line, no pipe, cut to SAMPLE_CHARS."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= SAMPLE_CHARS else text[: SAMPLE_CHARS - 1] + "…"


def samples_section(runs: list[Run]) -> list[str]:
    """A few generations of each run's last evaluation, with how many of them were right."""
    lines = ["## Samples", ""]
    for run in runs:
        found = last_samples(run)
        if found is None:
            lines += [f"- `{run.name}`: no generations kept (eval.generate is off, or no evaluation ran yet)", ""]
            continue
        path, samples = found
        correct = sum(bool(sample.get("correct")) for sample in samples)
        lines += [f"`{run.name}`, {path.stem}: {correct} of {len(samples)} correct; the first {SAMPLES_SHOWN}:", ""]
        lines += ["| prompt | answer | reference | correct |", "|---|---|---|---|"]
        lines += [
            f"| {_cell(s.get('prompt'))} | {_cell(s.get('answer'))} | {_cell(s.get('reference'))} | "
            f"{'yes' if s.get('correct') else 'no'} |"
            for s in samples[:SAMPLES_SHOWN]
        ]
        lines.append("")
    return lines


def experts_section(runs: list[Run]) -> list[str]:
    """The MoE layers' load in each run's last logged window: max/mean tokens per expert and idle experts."""
    lines = []
    for run in runs:
        last = next((e for e in reversed(run.events) if e.get("kind") == "train" and e.get("expert_load")), None)
        if last is None:
            continue
        load = last["expert_load"]
        lines += [f"`{run.name}`, step {last.get('step')}: router aux loss {_fmt(last.get('router_aux_loss'), '.4f')}",
                  "", "| layer | max / mean tokens per expert | experts with no token |", "|---|---|---|"]
        for layer, ratio, idle in zip(load["layers"], load["max_over_mean"], load["idle_experts"], strict=True):
            lines.append(f"| {layer} | {_fmt(ratio, '.2f')} | {len(idle)}{f' {idle[:8]}' if idle else ''} |")
        lines.append("")
    return ["## Experts", "", *lines] if lines else []


def objective_section(runs: list[Run]) -> list[str]:
    """Per objective, each run's latest own figures, train and eval (DPO: its rewards and log-probabilities)."""
    lines = []
    for objective, names in run_layout.OBJECTIVE_FIGURES.items():
        rows = []
        for run, kind in ((run, kind) for run in runs for kind in ("train", "eval")):
            prefix = "eval_" if kind == "eval" else ""
            last = [_last(run, kind, prefix + name) for name in names]
            if any(value is not None for value in last):
                rows.append(f"| {run.name} | {kind} | " + " | ".join(_fmt(value, ".4g") for value in last) + " |")
        if rows:
            lines += [f"## {objective.upper()}: the latest figures", "", f"| run | | {' | '.join(names)} |",
                      "|---|---|" + "---|" * len(names), *rows, ""]
    return lines


def _last(run: Run, kind: str, field: str) -> float | None:
    values = series(run.events, kind, field)[1]
    return values[-1] if values else None


def markdown(runs: list[Run], plots: list[Path]) -> str:
    lines = ["# trainyard report", ""]
    lines += [f"- `{run.name}`: {run.path}" for run in runs]
    lines += ["", *summary_table(runs), "", "## Events", ""]
    for run in runs:
        notes = notable_events(run)
        lines.append(f"- `{run.name}`: " + ("; ".join(notes) if notes else "nothing unusual"))
    lines += ["", *objective_section(runs), *experts_section(runs), *samples_section(runs), "## Plots", ""]
    lines += [f"![{path.stem}]({path.name})" for path in plots]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- entry


def default_out(run_dirs: list[Path]) -> Path:
    return Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else Path(DEFAULT_MULTI_RUN_OUT)


def check_out(out: Path, force: bool) -> None:
    """An explicit --out keeps the user's files: report files already there need --force."""
    from trainyard.errors import OptionError

    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out} is a file, not a folder", fix="pass a folder for the PNGs and report.md")
    taken = [name for name in (*(plot.file for plot in ALL_PLOTS), "report.md") if (out / name).exists()]
    if taken and not force:
        raise OptionError(
            f"--out {out} already holds {', '.join(taken)}",
            fix="choose a new folder, or pass --force to replace those files",
        )


def write_report(run_dirs: list[Path], out: Path | None = None, force: bool = False) -> list[Path]:
    """Write the PNGs and report.md under `out`; return the files written.

    The default folder is trainyard's own and is refreshed; a folder given as `out` is checked first.
    """
    if not run_dirs:
        raise RunDirError("no run dir given", fix="pass one or more run dirs: trainyard report runs/NAME")
    runs = load_runs(run_dirs)
    if out is not None:
        check_out(Path(out), force)
    out = Path(out) if out is not None else default_out(run_dirs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create --out {out}: {err.strerror}", fix="pass a writable --out directory") from None
    plots = [path for plot in ALL_PLOTS if (path := draw(runs, plot, out)) is not None]
    report = out / "report.md"
    report.write_text(markdown(runs, plots))
    return [*plots, report]

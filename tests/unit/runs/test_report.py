"""`trainyard report` on two synthetic run dirs: a finished run and one that died mid-way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from tests.conftest import run_cli
from tests.unit.runs.dpo_run import write_dpo_run
from trainyard.errors import RunDirError
from trainyard.runs.report import OBJECTIVE_PLOTS, PLOTS, draw, load_run, series, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN_COLORS = {"baseline": (0x1F, 0x77, 0xB4), "high-lr": (0xFF, 0x7F, 0x0E)}  # matplotlib C0, C1
START = 1_795_000_000.0


def train_event(step: int, loss: float, lr: float, tokens_per_s: float, memory_gib: float) -> dict:
    return {
        "kind": "train",
        "time": START + step * 2.0,
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": (1.0 + 50 * lr) / math.sqrt(step),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": tokens_per_s / 2,
        "achieved_flops_per_rank": 1.2e10,
        "data_wait_share": 0.02,
        "peak_memory_bytes": int(memory_gib * 1024**3),
        "tokens": step * 1536,
    }


def write_run(run_dir: Path, lr: float, finished: bool) -> None:
    """metrics.jsonl as the trainer writes it; the unfinished run hits a NaN and is killed mid-line."""
    run_dir.mkdir(parents=True)
    events = [
        {
            "kind": "eval",
            "time": START,
            "step": 0,
            "baseline": True,
            "eval_loss": 5.6,
            "eval_ppl": 270.4,
            "eval_tokens": 768,
            "eval_accuracy": 0.0,
        }
    ]
    for step in range(5, 41, 5):
        loss = 5.5 * math.exp(-step * lr * 20) + 1.0
        if not finished and step >= 35:
            loss = float("nan")
        events.append(
            train_event(step, loss, lr * (1 - step / 45), 40_000.0 + 2e5 * lr + 100 * step, 0.49 + lr + step / 1000)
        )
        if not finished and step == 35:
            events.append({"kind": "system", "time": START + 70.5, "step": 35, "event": "skipped_nonfinite_step"})
        if step % 10 == 0:
            events.append(
                {
                    "kind": "eval",
                    "time": START + step * 2 + 0.5,
                    "step": step,
                    "eval_loss": loss + 0.1,
                    "eval_ppl": 20.0,
                    "eval_tokens": 768,
                    "eval_accuracy": step / 50,
                }
            )
        if step % 20 == 0:
            events.append(
                {
                    "kind": "checkpoint",
                    "time": START + step * 2 + 1,
                    "step": step,
                    "mode": "lite",
                    "path": str(run_dir / f"checkpoints/step-{step:08d}"),
                    "seconds": 0.4,
                }
            )
    text = "".join(json.dumps(event) + "\n" for event in events)
    (run_dir / "env.json").write_text(json.dumps({"python": "3.11.7", "world_size": 2, "device": "cpu", "hosts": []}))
    if not finished:
        text += '{"kind": "train", "time": 17950'  # the line a killed rank 0 left half-written
    (run_dir / "metrics.jsonl").write_text(text)
    if finished:
        summary = {
            "wall_time_s": 3725.0,
            "steps": 40,
            "tokens": 61_440,
            "tokens_per_s": 51_234.5,
            "tokens_per_s_per_rank": 25_617.2,
            "world_size": 2,
            "strategy": "ddp",
            "accumulation": 1,
            "device": "cpu",
            "first_train_loss": 4.2117,
            "final_train_loss": 1.0871,
            "final_eval_loss": 1.1871,
            "final_eval_accuracy": 0.8,
            "baseline_eval_loss": 5.6,
            "baseline_eval_accuracy": 0.0,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


@pytest.fixture
def two_runs(tmp_path: Path) -> list[Path]:
    runs = [tmp_path / "runs" / "baseline", tmp_path / "runs" / "high-lr"]
    write_run(runs[0], lr=0.003, finished=True)
    write_run(runs[1], lr=0.02, finished=False)
    return runs


def pixels_of(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
    target = np.array(rgb) / 255.0
    return int((np.abs(image[..., :3] - target).max(axis=-1) < 0.02).sum())


def test_report_plots_both_runs_and_summarises_them(two_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = run_cli("report", *map(str, two_runs), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    pngs = ["loss.png", "tokens_per_s.png", "peak_memory.png", "lr.png", "grad_norm.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*pngs, "report.md"])
    for name in pngs:
        path = out / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = imread(path)
        assert image.shape[0] >= 300 and image.shape[1] >= 600
        for run, rgb in RUN_COLORS.items():
            assert pixels_of(image, rgb) > 200, f"{name}: no line of {run}"  # a legend swatch alone has ~40
    report = (out / "report.md").read_text()
    assert "`baseline`" in report and "`high-lr`" in report
    baseline_row = next(line for line in report.splitlines() if line.startswith("| baseline |"))
    assert baseline_row.split(" | ")[1:] == [
        "finished",
        "2",
        "40",
        "4.2117",
        "1.0871",
        "1.1871",
        "80.0%",
        "51,234",
        "1h 02m 05s |",
    ]
    crashed_row = next(line for line in report.splitlines() if line.startswith("| high-lr |"))
    assert crashed_row.split(" | ")[1:5] == ["no summary.json (crashed or running)", "2", "40", "1.7443"]
    assert "non-finite train loss first at step 35" in report
    assert "skipped_nonfinite_step" in report and "1 unreadable line(s)" in report
    assert "2 checkpoint(s), last at step 40" in report
    assert all(f"]({name})" in report for name in pngs)


def test_a_memory_growth_alarm_is_marked_on_the_memory_plot_and_told_in_the_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "baseline"
    write_run(run_dir, lr=0.003, finished=True)
    memory_plot = next(plot for plot in PLOTS if plot.file == "peak_memory.png")
    (tmp_path / "plain").mkdir()
    plain = pixels_of(imread(draw([load_run(run_dir)], memory_plot, tmp_path / "plain")), RUN_COLORS["baseline"])
    alarm = {"kind": "system", "time": START + 61, "step": 30, "event": "memory_growth", "ranks": [1],
             "bytes_per_step": 33554432, "memory_bytes": 2**31, "available_bytes": 2**33, "runs_out_at_step": 286}
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps(alarm) + "\n")
    out = tmp_path / "marked"
    write_report([run_dir], out)
    marked = pixels_of(imread(out / "peak_memory.png"), RUN_COLORS["baseline"])
    assert marked > plain + 100  # the dotted line across the axes, in the run's colour
    report = (out / "report.md").read_text()
    assert ("memory grew steadily from step 30 on: 33,554,432 bytes per step on rank(s) [1] at step 30, "
            "runs out near step 286") in report


def test_a_resumed_run_keeps_the_last_value_of_each_step() -> None:
    events = [
        {"kind": "train", "step": 10, "loss": 3.0},
        {"kind": "train", "step": 20, "loss": 2.5},
        {"kind": "eval", "step": 20, "eval_loss": 2.7},
        {"kind": "train", "step": 20, "loss": 2.4},  # logged again after resuming from step 10
        {"kind": "train", "step": 15, "loss": 2.8},
    ]
    assert series(events, "train", "loss") == ([10, 15, 20], [3.0, 2.8, 2.4])


def test_missing_run_dir_is_a_user_error(tmp_path: Path) -> None:
    result = run_cli("report", str(tmp_path / "nope"), cwd=tmp_path)
    assert result.returncode == 2
    assert f"run dir {tmp_path / 'nope'} does not exist" in " ".join(result.stderr.split())  # rich wraps lines
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="metrics.jsonl is missing"):
        write_report([tmp_path / "empty"], tmp_path / "out")


def test_report_shows_a_few_generations_of_the_last_evaluation(two_runs: list[Path]) -> None:
    """Evaluation keeps its generations in samples/step-XXXXXXXX.jsonl; the report shows the newest file's first few."""
    samples = two_runs[0] / "samples"
    samples.mkdir()
    for step, answer in ((10, "June 1, 2024"), (40, "March 3, 2021")):
        rows = [
            {"index": i, "prompt": f"Rewrite 2021-03-0{i} | as words", "answer": answer, "reference": "March 3, 2021",
             "correct": answer == "March 3, 2021" and i == 3}
            for i in range(8)
        ]
        (samples / f"step-{step:08d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (samples / "rank-0.jsonl").write_text('{"rows": [1, 2]}\n')  # the data-order audit, not generations
    report = next(p for p in write_report(two_runs, two_runs[0].parent / "report") if p.name == "report.md")
    text = report.read_text()
    section = text[text.index("## Samples") : text.index("## Plots")]
    assert "`baseline`, step-00000040: 1 of 8 correct" in section
    assert "| Rewrite 2021-03-00 \\| as words | March 3, 2021 | March 3, 2021 | no |" in section
    assert section.count("| Rewrite") == 5 and "June 1, 2024" not in section
    assert "`high-lr`: no generations kept" in section


def test_a_dpo_run_gets_plots_of_its_own_figures_train_and_eval(tmp_path: Path) -> None:
    """DPO is judged by its reward margin and accuracy, the chosen and rejected rewards: each a plot with the train
    and the eval line, beside an SFT run that logged none of them (its colour stays off those plots)."""
    dpo = write_dpo_run(tmp_path / "runs", steps=6, eval_every=3)
    sft = tmp_path / "runs" / "sft"
    write_run(sft, lr=0.003, finished=True)
    out = tmp_path / "report"
    written = {path.name for path in write_report([dpo, sft], out)}
    own = {"dpo_margins.png", "dpo_accuracies.png", "dpo_rewards.png", "dpo_logps.png"}
    assert own <= written
    events = load_run(dpo).events
    for plot in OBJECTIVE_PLOTS["dpo"]:
        assert {line.kind for line in plot.lines} == {"train", "eval"}
        for line in plot.lines:
            steps, _ = series(events, line.kind, line.field)
            assert steps == ([1, 2, 3, 4, 5, 6] if line.kind == "train" else [3, 6]), (plot.file, line.field)
        image = imread(out / plot.file)
        assert pixels_of(image, RUN_COLORS["baseline"]) > 200, plot.file  # the DPO run's colour, C0
        assert pixels_of(image, RUN_COLORS["high-lr"]) == 0, plot.file  # the SFT run's, C1: not drawn
    report = (out / "report.md").read_text()
    assert "| dpo | train | 0.24 | 0.8 | 0.06 | -0.18 | -40.6 | -43.4 |" in report, report
    assert "| dpo | eval | 0.216 | 0.72 | 0.054 | -0.162 | -36.54 | -39.06 |" in report, report
    assert "| sft | train |" not in report and all(f"]({name})" in report for name in own)

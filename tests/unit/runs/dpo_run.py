"""A DPO run dir as the trainer writes it: each train event from the log window's own figures (DPO's sums riding
metrics.LogWindow), each eval event with evaluate's names, both through metrics.MetricsSink."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainyard.config_file import load_config
from trainyard.dist import DistInfo
from trainyard.metrics import LogWindow, MetricsSink
from trainyard.objective import PairFigures
from trainyard.preference.loss import STATS

CPU = torch.device("cpu")
PAIRS = 4


def pair_figures(step: int) -> dict[str, float]:
    """A run that learns: the margin and the accuracy rise, both log-probabilities fall (the rejected faster)."""
    chosen, rejected = 0.01 * step, -0.03 * step
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
            "rewards/accuracies": min(1.0, 0.5 + 0.05 * step), "logps/chosen": -40.0 - 0.1 * step,
            "logps/rejected": -41.0 - 0.4 * step}


def write_dpo_run(output_dir: Path, steps: int = 6, eval_every: int = 3, run_name: str = "dpo") -> Path:
    """`steps` logged steps and an evaluation every `eval_every`; returns the run dir."""
    cfg = load_config("tiny", [f"output_dir={output_dir}", f"run_name={run_name}", "train.objective=dpo",
                               "log.tensorboard=false", "log.progress=false", f"train.max_steps={steps}"])
    cfg.run_dir.mkdir(parents=True)
    sink = MetricsSink(cfg, DistInfo(0, 1, 0, 1, CPU, None), logging.getLogger("test-dpo-run"))
    window = LogWindow(CPU, None, peak=None, pair_figures=PairFigures(CPU))
    one = torch.tensor(1.0, dtype=torch.float64)
    for step in range(1, steps + 1):
        figures = pair_figures(step)
        window.pair_figures.add(PAIRS, PAIRS * torch.tensor([figures[name] for name in STATS]))
        window.add(0.69 * PAIRS * one, PAIRS * one, 256 * one, flops=1e9, seconds=1.0, data_wait=0.0)
        sink.emit("train", step=step, lr=1e-4, grad_norm=1.0, **window.figures())
        window.reset()
        if step % eval_every == 0:
            held_out = {f"eval_{name}": 0.9 * value for name, value in pair_figures(step).items()}
            sink.emit("eval", step=step, eval_loss=0.7, eval_pairs=8, **held_out)
    sink.close()
    return cfg.run_dir

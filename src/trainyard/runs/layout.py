"""Every name inside a run directory (`<output_dir>/<run_name>/`), in one place: what writes a run and what reads
one (status, report, diagnose, resume, export) agree on them here. Imports no other room.

    config.yaml  env.json  metrics.jsonl  summary.json  wandb-run-id
    checkpoints/  logs/rank-<r>.log  heartbeats/rank-<r>.json  flight/  samples/  tensorboard/
"""

from __future__ import annotations

CONFIG = "config.yaml"
"""The resolved job, secrets redacted."""
ENV = "env.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WANDB_ID = "wandb-run-id"
CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"
"""Inside checkpoints/step-XXXXXXXX/, written last: the commit, with each file's size (atomic.write_manifest)."""
LOGS = "logs"
HEARTBEATS = "heartbeats"
FLIGHT = "flight"
"""Flight-recorder dumps after a failed collective."""
SAMPLES = "samples"
"""Evaluation's generations (step-XXXXXXXX.jsonl) and the rows each rank read (rank-<r>.jsonl)."""
TENSORBOARD = "tensorboard"
MARKERS = (METRICS, ENV, CONFIG, HEARTBEATS, LOGS, CHECKPOINTS)
"""What only a run directory holds: one of them tells a run dir from any folder."""
OBJECTIVE_FIGURES = {
    "dpo": ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected", "logps/chosen",
            "logps/rejected"),
}
"""What each objective is judged by beside its loss, as metrics.jsonl names them (TRL's names): train events carry
them as they are, eval events with `eval_` before them. SFT's are the loss and eval's accuracy and perplexity."""

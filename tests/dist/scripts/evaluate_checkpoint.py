"""Run under torchrun: `trainyard eval CONFIG OVERRIDES --checkpoint STEP` as each rank runs it (the CLI's
`evaluate_checkpoint`); rank 0 writes the figures it returned to OUT as JSON.

argv: OUT CONFIG STEP [OVERRIDE ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as torch_dist

from trainyard import dist
from trainyard.checkpoint.evaluate import evaluate_checkpoint
from trainyard.config_file import load_config


def main() -> None:
    out, config, step, *overrides = sys.argv[1:]
    figures = evaluate_checkpoint(load_config(config, overrides), Path(step))
    if not torch_dist.is_initialized() or torch_dist.get_rank() == 0:
        Path(out).write_text(json.dumps(figures))
    dist.exit_process(0)


if __name__ == "__main__":
    main()

"""train.micro_batch_tokens in words: the dry run and the run's log say the same of a step (its rows per rank, in
about how many micro-batches of up to N tokens), not the row path's accumulation."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import TINY, run_cli
from trainyard.config_file import load_config
from trainyard.train import recipe as trainer

JOB = ["dist.strategy=none", "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false",
       "checkpoint.every_minutes=0", "checkpoint.preemption_signals=[]", "log.tensorboard=false", "train.max_steps=1",
       "train.micro_batch_size=4", "train.global_batch_size=16", "data.synthetic_train_size=48",
       "train.precision=fp32", "train.micro_batch_tokens=300"]
STEP = re.compile(r"each step's 16 rows per rank \(about [\d,]+ tokens each\) in about (\d+) micro-batch\(es\) "
                  r"of up to 300 tokens, as many on every rank")


def test_the_dry_run_and_the_run_s_log_say_one_step_of_token_bounded_micro_batches(tmp_path: Path) -> None:
    job = [*JOB, f"output_dir={tmp_path}", "run_name=words"]
    planned = run_cli("train", TINY, *job, "--dry-run", "--gpu", "cpu", "--gpus-per-node", "1")
    assert planned.returncode == 0, planned.stderr[-2000:]
    trainer.run(load_config(TINY, job))
    logged = (tmp_path / "words" / "logs" / "rank-0.log").read_text()
    said, ran = STEP.search(planned.stdout), STEP.search(logged)
    assert said and ran, (planned.stdout, logged)
    assert said.group(0) == ran.group(0) and int(ran.group(1)) == 6  # 16 rows of about 100 tokens, 300 at a time
    assert "accumulation 4" not in logged

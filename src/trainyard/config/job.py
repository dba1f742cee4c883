"""The whole job: its sections, the checks that span sections, and where each field was set."""

from __future__ import annotations

import math
import re
from pathlib import Path

from pydantic import PrivateAttr, ValidationInfo, model_validator

from trainyard.config.data import DataConfig
from trainyard.config.dist import DilocoConfig, DistConfig
from trainyard.config.loop import CheckpointConfig, EvalConfig, LogConfig, TrainConfig
from trainyard.config.model import LoraConfig, ModelConfig, quantize_problems
from trainyard.config.preference import DpoConfig, objective_problems
from trainyard.config.section import Section, field_and_where


class JobConfig(Section):
    run_name: str = "run"
    output_dir: str = "runs"
    model: ModelConfig = ModelConfig(path="builtin:smollm2-135m-instruct")
    lora: LoraConfig = LoraConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dist: DistConfig = DistConfig()
    diloco: DilocoConfig = DilocoConfig()
    log: LogConfig = LogConfig()
    dpo: DpoConfig = DpoConfig()
    _where: dict[str, str] = PrivateAttr(default_factory=dict)
    """Where each field was set ("file:line" or "override 'k=v'"), for errors found after loading."""
    _notes: list[str] = PrivateAttr(default_factory=list)
    """What loading decided that the user did not write (a command-line length replacing the file's): said once."""

    def where(self, field: str) -> str | None:
        """The file:line (or override) that set `field` or its nearest parent, if known."""
        parts = field.split(".")
        for depth in range(len(parts), 0, -1):
            found = self._where.get(".".join(parts[:depth]))
            if found:
                return found
        return None

    @model_validator(mode="after")
    def _run_name_is_a_folder_name(self) -> "JobConfig":
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.run_name):
            raise ValueError("run_name must be letters, digits, '.', '_' or '-'")
        return self

    @model_validator(mode="after")
    def _shard_size_only_for_a_sharded_site(self) -> "JobConfig":
        if self.dist.strategy == "diloco" and self.dist.shard_size is not None and self.diloco.inner != "hsdp":
            raise ValueError(
                f"dist.shard_size is set but diloco.inner is {self.diloco.inner}: only hsdp within a site has shard "
                "groups; set diloco.inner: hsdp, or remove dist.shard_size"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_fits_the_job(self) -> "JobConfig":
        size = self.dist.context_parallel
        if size in (1, "auto"):  # auto: 1 where these rules refuse CP (plan.context_parallel)
            return self
        if self.train.objective == "dpo" and self.dpo.loss == "orpo":
            raise ValueError(f"dist.context_parallel {size} runs dpo.loss orpo not yet (its chosen cross-entropy "
                             "reads each document's next token, on another rank at a slice's end): set "
                             "dist.context_parallel: 1, or another dpo.loss")
        if not self.data.padding_free:
            raise ValueError(f"dist.context_parallel {size} slices padding-free rows: set data.padding_free: true")
        if self.dist.strategy == "diloco" and self.diloco.inner == "ddp":
            raise ValueError(f"dist.context_parallel {size} under dist.strategy diloco is carved out of each "
                             "site's shard dimension, and diloco.inner ddp shards nothing: set diloco.inner: hsdp "
                             "or fsdp, or dist.context_parallel: 1")
        return self

    @model_validator(mode="after")
    def _token_micro_batches_fit(self, info: ValidationInfo) -> "JobConfig":
        """train.micro_batch_tokens concatenates rows into one padding-free row: rows of their own length each."""
        if self.train.micro_batch_tokens is None:
            return self
        tokens = field_and_where(info, "train.micro_batch_tokens")
        if not self.data.padding_free:
            raise ValueError(f"{tokens} packs padding-free micro-batches, but data.padding_free is false: set "
                             "data.padding_free: true, or remove train.micro_batch_tokens (micro_batch_size rows)")
        if self.data.mixture:
            raise ValueError(f"{tokens}: a mixture's rows all fill data.max_length {self.data.max_length}, so set "
                             "train.micro_batch_size (N / data.max_length rows) instead")
        return self

    @model_validator(mode="after")
    def _objective_settings_fit(self, info: ValidationInfo) -> "JobConfig":
        problems = objective_problems(self.train.objective, self.dpo, self.data)
        if problems:
            raise ValueError("; ".join(f"{field_and_where(info, field)} {why}" for field, why in problems))
        return self

    @model_validator(mode="after")
    def _quantize_fits_the_job(self, info: ValidationInfo) -> "JobConfig":
        problems = quantize_problems(self.model, self.lora, self.checkpoint.save_frozen)
        if problems:
            raise ValueError("; ".join(f"{field_and_where(info, field)} {why}" for field, why in problems))
        return self

    @model_validator(mode="after")
    def _fault_tolerance_is_diloco_s(self) -> "JobConfig":
        if self.diloco.fault_tolerant and self.dist.strategy != "diloco":
            raise ValueError(
                f"diloco.fault_tolerant is set but dist.strategy is {self.dist.strategy}: set dist.strategy: diloco"
            )
        return self

    @model_validator(mode="after")
    def _epochs_need_rows(self, info: ValidationInfo) -> "JobConfig":
        """A mixture is an endless stream of token rows: it has no rows to count epochs over."""
        if self.train.epochs is not None and self.data.mixture:
            raise ValueError(
                f"{field_and_where(info, 'train.epochs')} counts passes over data.path's rows, but "
                f"{field_and_where(info, 'data.mixture')} is a stream with no epoch: set train.total_tokens "
                "(or train.max_steps) instead"
            )
        return self

    @model_validator(mode="after")
    def _steps_from_token_budget(self) -> "JobConfig":
        """train.total_tokens sets max_steps here, once, so every reader of max_steps (schedule, ETA, status,
        estimate) sees the same number; a run's written config holds both, and they agree."""
        train = self.train
        if train.total_tokens is None:
            return self
        if train.global_batch_tokens is not None:
            per_step, rule = train.global_batch_tokens, f"train.global_batch_tokens {train.global_batch_tokens}"
        elif train.global_batch_size is not None:
            per_step = train.global_batch_size * self.data.max_length
            rule = f"train.global_batch_size x data.max_length = {train.global_batch_size} x {self.data.max_length}"
        else:
            raise ValueError(
                "train.total_tokens needs the global batch in tokens: set train.global_batch_tokens (or "
                "train.global_batch_size), so the number of steps does not depend on the world size"
            )
        steps = math.ceil(train.total_tokens / per_step)
        if "max_steps" in train.model_fields_set and train.max_steps != steps:
            raise ValueError(
                f"set train.max_steps or train.total_tokens, not both: total_tokens {train.total_tokens} over "
                f"{rule} tokens per step is {steps} steps, max_steps says {train.max_steps}"
            )
        train.max_steps = steps
        return self

    @property
    def run_dir(self) -> Path:
        """A fault-tolerant DiLoCo site keeps its own run dir: its launch comes and goes on its own."""
        root = Path(self.output_dir) / self.run_name
        return root / f"site-{self.diloco.site}" if self.diloco.fault_tolerant else root

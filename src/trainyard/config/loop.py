"""The sections of the training loop: its length, batch and optimizer (train), eval, checkpoints and logging."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainyard.config.section import Section, field_and_where


class TrainConfig(Section):
    objective: Literal["sft", "dpo"] = "sft"
    """sft: cross-entropy on the target tokens. dpo: preference tuning on prompt/chosen/rejected pairs, with the
    loss the `dpo` section names."""
    max_steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    micro_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    """Padding-free micro-batches of up to this many tokens instead of micro_batch_size rows: each step's rows (still
    micro_batch_size x accumulation per rank, so the global batch and epochs do not change) go, in order, into as
    few micro-batches as hold them; a row longer than N is a micro-batch of its own. auto: the largest N whose
    estimated peak fits 90% of the device (plan/batching.py; on a CPU the data's largest micro-batch of
    micro_batch_size rows). Needs data.padding_free; not with data.mixture."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step over all ranks; accumulation = this / (micro * world)."""
    global_batch_tokens: int | None = Field(None, ge=1)
    """Tokens per optimizer step over all ranks, counted as micro * max_length per micro-batch."""
    total_tokens: int | None = Field(None, ge=1)
    """Train on this many tokens instead of max_steps: max_steps = ceil(total_tokens / tokens per global batch),
    which needs global_batch_tokens (or global_batch_size, x data.max_length) so it holds on any world size."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the training rows instead of max_steps (3, or 0.5 for half of them): the trainer sets
    max_steps = ceil(epochs x rows / global batch in samples) once the data is prepared (rows after bad rows are
    dropped; see `batch.steps_for_epochs`). A resume keeps the global batch, so the steps too. Not with data.mixture."""
    epoch_rows: int | None = Field(None, ge=1)
    """Written by the run into its config.yaml, not for you to set: the training rows train.epochs counted when it
    set max_steps, which is what lets that file hold both epochs and max_steps."""
    lr: float = Field(2e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = Field(1.0, ge=0.0)
    """0 turns clipping off."""
    seed: int = 42
    on_nonfinite: Literal["error", "skip"] = "error"
    worst_batch_first: bool = True
    """The first optimizer step trains the epoch's largest rows (most tokens: the longest padded rows too), so a
    job that runs out of memory does so at step 1, not at hour 10; then the sampler's order resumes, every row still
    trained once per epoch. The dry run prints that micro-batch's tokens."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw (betas, weight_decay), or plain SGD without momentum (a linear update: DiLoCo's algebra tests)."""
    compile: Literal["auto"] | bool = "auto"
    """torch.compile each whole decoder block (attention, norms, MLP, residuals), after activation checkpointing and
    before sharding; the first step pays the compile, which the log shows and the dry run's estimate counts. auto:
    on CUDA; not on CPU, where a SmolLM2-135M LoRA step ran 6% faster compiled after ~50 s of compiling, repaid only
    after ~110 steps (parallel/compile.py).
    true/false: always/never. A block whose graph breaks runs eagerly, with a warning. Needs a C++ compiler on CPU."""
    loss_chunk_tokens: int | None = Field(None, ge=0)
    """The loss projects hidden states onto the vocabulary this many target tokens at a time, and computes each
    chunk's gradients at once, so only one chunk of [tokens, vocab] fp32 logits ever exists, forward and backward.
    None: as many tokens as fit LOSS_CHUNK_BYTES (256 MiB) of fp32 logits (512 for a 128k vocabulary); 0: the
    whole [tokens, vocab] logits at once, as transformers computes them."""
    precision: Literal["auto", "bf16-mixed", "fp32", "bf16", "fp8"] = "auto"
    """bf16-mixed: fp32 master weights and AdamW moments, bf16 compute, fp32 gradient reduction.
    bf16: everything in bf16 (least memory; small updates round away). auto: bf16-mixed on GPUs with
    bf16 and on CPUs with native bf16 matrix units (AMX, AVX512-BF16), fp32 otherwise.
    fp8: bf16-mixed whose decoder blocks' linear products run in FP8 (torchao float8 training; LoRA: the frozen
    base layers in FP8, the adapters in bf16). Linears whose dimensions are not multiples of 16 stay bf16 and the
    log names them; the head, embeddings and routed experts stay bf16. Needs a GPU of compute capability 8.9 or
    more (L4, H100, H200); refused elsewhere."""
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    """train.precision fp8's scales. tensorwise: one scale per tensor, and under FSDP2/HSDP the weights are
    all-gathered in FP8 (half the bytes of bf16). rowwise: one scale per row (more accurate, slower; gathers in
    bf16)."""

    @model_validator(mode="after")
    def _one_batch_rule(self) -> "TrainConfig":
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set train.global_batch_size or train.global_batch_tokens, not both")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"train.betas {list(self.betas)} must each be in [0, 1), e.g. [0.9, 0.999]")
        return self

    @model_validator(mode="after")
    def _one_length(self, info: ValidationInfo) -> "TrainConfig":
        """epochs replaces max_steps and total_tokens. max_steps may come with it only as the run derived it (its
        config.yaml, marked by epoch_rows); max_steps with total_tokens is JobConfig's check (they must agree)."""
        if self.epochs is None:
            return self
        if self.total_tokens is not None:
            other = "train.total_tokens"
        elif "max_steps" in self.model_fields_set and self.epoch_rows is None:
            other = "train.max_steps"
        else:
            return self
        raise ValueError(
            f"set {field_and_where(info, other)} or {field_and_where(info, 'train.epochs')}, not both: "
            "each sets the run's length; remove one (on the command line ~train.max_steps removes the file's key; a "
            "length given there replaces the file's by itself)"
        )


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """0 turns periodic eval off."""
    subset_size: int = Field(200, ge=1)
    seed: int = 1234
    batch_size: int = Field(8, ge=1)
    baseline: bool = False
    """Evaluate once before the first step."""
    at_end: bool = True
    generate: bool = False
    """Exact-match accuracy by greedy generation, for data that defines an answer."""
    max_new_tokens: int = Field(32, ge=1)


class CheckpointConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Full checkpoints (exact resume) every N steps; 0 turns them off."""
    every_minutes: Annotated[float, Field(ge=0.0)] | Literal["auto"] = 30.0
    """Also a full checkpoint when this much time passed since the last (rank 0 decides); 0 turns it off.
    auto: the Young/Daly interval sqrt(2 x save stall x MTBF of the job), from the measured stall of the last full
    save and mtbf_hours / nodes (the first timed save comes after 10 minutes, or the first every_steps save)."""
    lite_every_steps: int = Field(0, ge=0)
    """Lite checkpoints (the LoRA adapter only, PEFT format) every N steps; 0 turns them off."""
    keep_last: int = Field(3, ge=1)
    """Full checkpoints kept; the newest and the one resumed from are never deleted."""
    async_save: bool = Field(False, alias="async")
    """Stage to CPU and write in the background; training blocks only for the copy."""
    save_frozen: bool = False
    """Also store frozen base weights in full checkpoints (off: they come from model.path)."""
    at_end: bool = True
    resume: str = "auto"
    """auto (newest committed checkpoint of this run, or fresh), never, or a checkpoint path."""
    on_error: Literal["stop", "continue"] = "stop"
    mtbf_hours: float = Field(24.0, gt=0)
    """Mean time between failures of one node, in hours: `trainyard estimate` divides it by the nodes and derives
    the checkpoint interval (Young/Daly) and the work a failure is expected to lose."""
    preemption_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = ["SIGTERM", "SIGUSR1"]


class LogConfig(Section):
    class Wandb(Section):
        """Where rank 0's W&B run goes. The API key is never here: WANDB_API_KEY or `wandb login`."""

        project: str = "trainyard"
        entity: str | None = None
        """Team or user (default: the key's own)."""
        group: str | None = None
        """Groups runs in the W&B UI, e.g. the runs of one sweep."""

    every_steps: int = Field(10, ge=1)
    """A train event every N steps: its figures cost one all-gather, other steps none."""
    progress: bool = True
    tensorboard: bool = True
    wandb: Wandb | None = None
    """W&B on rank 0: true (project trainyard), or {project, entity, group}; false or absent: off. The run's id is
    kept in the run dir (wandb-run-id), so a requeued or resumed job continues the same W&B run."""
    wandb_project: str | None = None
    """The old spelling of log.wandb.project (with log.wandb: true); read into log.wandb on load."""

    @field_validator("wandb", mode="before")
    @classmethod
    def _wandb_switch(cls, value: Any) -> Any:
        """`log.wandb: true` is W&B with the defaults; false is off."""
        if isinstance(value, bool):
            return {} if value else None
        return value

    @model_validator(mode="before")
    @classmethod
    def _old_wandb_project(cls, data: Any) -> Any:
        """Today's `log.wandb: true` + `log.wandb_project: P` keeps working, as log.wandb.project P."""
        if not isinstance(data, dict) or data.get("wandb_project") is None:
            return data
        data = dict(data)
        project, wandb = data.pop("wandb_project"), data.get("wandb")
        if isinstance(wandb, dict) and wandb.get("project", project) != project:
            raise ValueError("log.wandb_project is the old spelling of log.wandb.project: set only log.wandb.project")
        if wandb is True or isinstance(wandb, dict):
            data["wandb"] = {**(wandb if isinstance(wandb, dict) else {}), "project": project}
        return data

"""The job schema: every section and field, its defaults and checks, and the batch rule.

One YAML file describes a job; every field has a default so a file only says what differs.
config_file.py reads a YAML file and overrides into it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class ModelConfig(Section):
    path: str | None = None
    """HF model folder, hub id, a .gguf file, or `builtin:smollm2-135m-instruct`."""
    config: dict[str, Any] | None = None
    """Build from this HF config (needs `model_type`) with random init, instead of `path`."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; `builtin:bytes` for the local byte tokenizer. Default: `path`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """How frozen base weights are stored (LoRA); trainable ones follow train.precision. auto: the compute dtype."""
    gradient_checkpointing: bool | Literal["selective"] = False
    """Recompute each decoder layer's activations in the backward instead of keeping them. true: all of them (least
    memory, the slowest); selective: all but the matmul and attention outputs (most of the saving, less recompute)."""
    attn_implementation: Literal[
        "auto", "varlen", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"
    ] = "auto"
    """auto: flash_attention_2 on a GPU with flash-attn installed where it keeps every feature of the family, else
    varlen (each document of a padding-free row on its own, no mask, with the family's windows, soft-capping and
    sinks). sdpa/eager isolate documents with a dense mask; flex_attention with a block mask. A choice that would
    drop a feature of the family is refused."""
    trust_remote_code: bool = False
    cache_dir: str | None = None
    """Where GGUF files are converted to safetensors once, and a model.config job's random init is drawn once per
    node for its ranks to read their rows from. Default: ~/.cache/trainyard/models."""
    download_timeout_s: float | None = Field(None, gt=0)
    """How long the other processes of a node wait (on a file lock, in no collective) while the first downloads a
    hub id into the HF cache. Default: as long as the download takes."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of model.path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (for example: llama)")
        return self

    @field_validator("gradient_checkpointing", mode="wrap")
    @classmethod
    def _checkpointing_mode(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> bool | str:
        """One message naming the three choices, instead of pydantic's one per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be false, true (full) or selective") from None

    @field_validator("dtype")
    @classmethod
    def _no_float16(cls, dtype: str) -> str:
        if dtype == "float16":
            raise ValueError(
                "float16 overflows without a loss scaler, and trainyard has none: use bfloat16 (same memory, "
                "fp32's range) or auto"
            )
        return dtype


class LoraConfig(Section):
    enabled: bool = True
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get adapters, by name or name suffix (q_proj); all-linear: every linear layer but the head."""
    target_parameters: list[str] | Literal["auto"] = "auto"
    """Parameters that get adapters, by name or suffix (mlp.experts.gate_up_proj): how LoRA reaches MoE experts that
    transformers stores fused as one 3-D tensor [experts, out, in] instead of one linear layer each (PEFT's
    parameter targeting). auto: every 3-D parameter of the model, so routed experts carry adapters by default and a
    dense model gets none; [] names none itself (but see below).

    PEFT 0.21 treats gate_proj/up_proj/down_proj and the router `gate` in target_modules (all-linear includes them)
    as the pre-fusion names of the experts on the MoE models transformers fuses (glm4_moe, qwen2_moe, mixtral, ...):
    it moves them to these fused parameters (gate_up_proj at twice the rank) and the router's weight, so there the
    dense layers' MLP and the shared experts carry no adapter. trainyard keeps PEFT's choice: an exported adapter
    loads the same way. The router is the exception: it stays frozen (in fp32, as the family keeps it) unless
    target_modules names `gate` itself, or target_parameters names its `gate.weight`."""
    moe_adapter: Literal["grouped", "peft"] = "grouped"
    """How fused experts' adapters run. grouped: the experts as transformers' grouped products over the tokens routed
    to each, each expert's adapter applied to its own tokens as two rank-r products (no expert-stack-sized tensor).
    peft: PEFT's own forward, which folds W + B·A over every expert of the layer on every step (for comparison).
    Same parameters and adapter files either way."""


class MixtureSource(Section):
    """One source of a pretraining mixture (`data.mixture`): documents' text, tokenized once by `trainyard prepare`."""

    path: str
    """A file, a glob (`data/*.jsonl`), a save_to_disk folder, an fsspec URL (`s3://...`, `memory://...`) of JSONL or
    Parquet, `hf://NAME` for a dataset read by `datasets.load_dataset(NAME, streaming=True)`, or real text every
    Python has: `builtin:python-stdlib` (the standard library's modules) and `builtin:pydoc-topics` (its English
    help topics)."""
    weight: float = Field(gt=0)
    """Relative share of the tokens drawn from this source; the weights need not sum to 1."""
    format: Literal["text"] = "text"
    """Pretraining text: each row's `text_field` is one document."""
    text_field: str = Field("text", min_length=1)


class DataConfig(Section):
    path: str = "builtin:dates"
    """JSONL/JSON/Parquet file, a `save_to_disk` folder, or a built-in task `builtin:NAME`."""
    eval_path: str | None = None
    format: Literal["auto", "alpaca", "chat", "text"] = "auto"
    max_length: int = Field(512, ge=8)
    packing: bool = False
    padding_free: bool = True
    """Each micro-batch is one row of its documents back to back, attention kept per document: no padding is
    computed. false: rows padded to the longest in the micro-batch (for models whose attention ignores
    position_ids)."""
    train_on_prompt: bool = False
    chat_template: str | None = Field(None, min_length=1)
    """How chat rows are rendered: a known family template (gemma3, gpt-oss, llama3, mistral, qwen3: the
    publishers' own, shipped with trainyard) or a path to a Jinja file. Default: the tokenizer's own template."""
    chat_template_kwargs: dict[str, Any] = {}
    """Variables for the chat template, as apply_chat_template's kwargs (e.g. enable_thinking: false)."""
    on_bad_row: Literal["error", "skip"] = "error"
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Hold out this share of `path` for eval when there is no `eval_path`."""
    cache_dir: str | None = None
    """Tokenized cache. Default: <output_dir>/.cache/data (shared by runs of one output_dir)."""
    synthetic_train_size: int = Field(2000, ge=1)
    synthetic_eval_size: int = Field(200, ge=1)
    prepare_timeout_s: float = Field(3600.0, gt=0)
    mixture: list[MixtureSource] | None = None
    """Pretraining: a weighted mixture of text sources, read as fixed-length rows of max_length tokens cut from
    token shards that `trainyard prepare` writes once. Replaces `path` (set one of them)."""
    mixture_exhausted: Literal["repeat", "stop"] = "repeat"
    """repeat: a source that runs out starts its next epoch; stop: the stream ends when the first source runs out."""
    shards_dir: str | None = None
    """Where prepared token shards live. Default: <output_dir>/.cache/shards."""

    @field_validator("chat_template")
    @classmethod
    def _known_template_or_path(cls, value: str | None) -> str | None:
        """A bare word must be a shipped template; anything with a / or a file suffix is a path, read later."""
        known = sorted(path.stem for path in (Path(__file__).parent / "data" / "templates").glob("*.jinja"))
        if value is None or value in known or "/" in value or "\\" in value or "." in value:
            return value
        raise ValueError(f"unknown chat template '{value}': use one of {', '.join(known)}, or a path to a .jinja file")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_trainyard_does_not_set(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Arguments of apply_chat_template that trainyard sets itself cannot be template variables."""
        reserved = {
            "conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message",
            "tokenize", "return_dict", "return_assistant_tokens_mask", "return_tensors", "padding", "truncation",
            "max_length", "tokenizer_kwargs", "sanitize_control_tokens",
        }  # fmt: skip
        clash = sorted(reserved.intersection(kwargs))
        if clash:
            raise ValueError(
                f"{', '.join(clash)} cannot be set here: trainyard sets it when rendering; remove it from "
                "data.chat_template_kwargs (only the template's own variables, such as enable_thinking, go there)"
            )
        return kwargs

    @model_validator(mode="after")
    def _path_or_mixture(self) -> "DataConfig":
        if self.mixture is not None and not self.mixture:
            raise ValueError("data.mixture needs at least one source ({path, weight}), or remove it")
        if self.mixture and "path" in self.model_fields_set:
            raise ValueError("set data.path or data.mixture, not both: data.path is not read when there is a mixture")
        if self.mixture and self.eval_fraction:
            raise ValueError("data.eval_fraction holds out rows of data.path; a mixture is evaluated on data.eval_path")
        return self


class TrainConfig(Section):
    max_steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(4, ge=1)
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
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw (betas, weight_decay), or plain SGD without momentum (a linear update: DiLoCo's algebra tests)."""
    compile: bool = False
    """torch.compile every decoder block's MLP. On CPU it cut a SmolLM2 LoRA step by ~12% once compiled, after
    ~15 s of compiling at the first step: worth it for long runs, not short ones. Needs a C++ compiler on CPU."""
    loss_chunk_tokens: int | None = Field(None, ge=0)
    """The loss projects hidden states onto the vocabulary this many target tokens at a time, and computes each
    chunk's gradients at once, so only one chunk of [tokens, vocab] fp32 logits ever exists, forward and backward.
    None: as many tokens as fit LOSS_CHUNK_BYTES (256 MiB) of fp32 logits (512 for a 128k vocabulary); 0: the
    whole [tokens, vocab] logits at once, as transformers computes them."""
    precision: Literal["auto", "bf16-mixed", "fp32", "bf16"] = "auto"
    """bf16-mixed: fp32 master weights and AdamW moments, bf16 compute, fp32 gradient reduction.
    bf16: everything in bf16 (least memory; small updates round away). auto: bf16-mixed on GPUs with
    bf16 and on CPUs with native bf16 matrix units (AMX, AVX512-BF16), fp32 otherwise."""

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
            f"set {_field_and_where(info, other)} or {_field_and_where(info, 'train.epochs')}, not both: "
            "each sets the run's length; remove one (an override cannot remove a key of the file)"
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


class DilocoConfig(Section):
    """DiLoCo (Douillard et al. 2023): each site takes sync_every inner steps on its own, then the sites average
    their pseudo-gradients (round-start weights minus current weights) and take one outer Nesterov step."""

    sync_every: int = Field(50, ge=1)
    """H: inner steps per round; the outer all-reduce of the trainable weights' size happens once per round."""
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Nesterov momentum of the outer SGD step; 0 turns momentum off."""
    groups: Literal["node"] | int = "node"
    """How the world splits into sites: node (one site per node), or a number of equal sites of consecutive ranks."""
    inner: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """The strategy inside a site. fsdp shards the site's weights, gradients and optimizer over its ranks (and the
    outer state with them): each rank then sends only its own shard's pseudo-gradient to its counterparts. hsdp,
    for a site of several nodes: shard within dist.shard_size ranks (a node by default), replicate across the
    site's shard groups; the replicas split their shard's outer sync between them."""
    pseudo_grad_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """What the outer sync sends: bf16 halves the bytes between sites; int8 (one scale per tensor) sends a quarter
    of fp32's between 2 sites (it is gathered, not reduced: (sites - 1) bytes per value per rank)."""
    sync_chunk_mib: float = Field(64.0, gt=0)
    """The outer sync walks the pseudo-gradient in chunks of this many MiB of fp32 values, through buffers made
    once: it holds about two chunks beyond the outer state instead of several copies of the model. Smaller chunks
    take more collectives per sync."""
    fault_tolerant: bool = False
    """Sites that drop out and come back (torchft, the `ft` extra): each site is its own launch and torch world, the
    outer average is over the sites present at each sync, and a returning site loads the round-start weights and
    outer state from a live peer. Needs diloco.site, diloco.sites and a lighthouse."""
    site: int | None = Field(None, ge=0)
    """fault_tolerant: this launch's site, 0 to sites - 1 (e.g. `diloco.site=1` on the launch's command line)."""
    sites: int | None = Field(None, ge=1)
    """fault_tolerant: how many sites the job has; each reads its own slice of the data, as one world would."""
    lighthouse: str | None = None
    """fault_tolerant: the torchft lighthouse, HOST:PORT (default: the TORCHFT_LIGHTHOUSE variable)."""
    quorum_timeout_s: float = Field(3600.0, gt=0)
    """fault_tolerant: how long a site waits at a sync for the quorum. A returning site waits in it for the others'
    next sync, so make it longer than a round."""

    @model_validator(mode="after")
    def _fault_tolerant_needs_its_site(self) -> "DilocoConfig":
        if not self.fault_tolerant:
            return self
        if self.site is None or self.sites is None or self.site >= self.sites:
            raise ValueError(
                f"diloco.fault_tolerant needs diloco.site below diloco.sites (site {self.site}, sites {self.sites}): "
                "set diloco.sites to the job's number of sites and diloco.site=S on each site's launch"
            )
        if self.pseudo_grad_dtype == "int8":
            raise ValueError(
                "diloco.pseudo_grad_dtype int8 is gathered, not reduced: torchft reduces only; with "
                "diloco.fault_tolerant use fp32 or bf16"
            )
        return self

    def chunk_elements(self, slices: int) -> int:
        """Values per chunk of the outer sync: a multiple of the ranks that split each chunk between them."""
        values = math.ceil(self.sync_chunk_mib * 2**20 / 4)
        return -(-values // slices) * slices


class DistConfig(Section):
    strategy: Literal["auto", "none", "ddp", "fsdp", "hsdp", "diloco"] = "auto"
    """auto: none alone, ddp while replicated state fits, else hsdp across nodes or fsdp within one.
    hsdp shards within a node and replicates across nodes: only a gradient all-reduce crosses the
    slow link, instead of every block's all-gather and reduce-scatter. diloco (the `diloco` section): sites
    train on their own for sync_every steps, then average once; for sites joined by a WAN."""
    shard_size: int | None = Field(None, ge=1)
    """hsdp (and diloco with inner hsdp): ranks per shard group (default: the processes per node); must divide
    the world size (a site's size under diloco)."""
    defer_grad_sync: bool = False
    """fsdp/hsdp with accumulation: reduce gradients only on a window's last micro-batch. Trades memory
    for speed: unsharded gradients of the whole model live until then (off: each micro-batch
    reduce-scatters and frees them; hsdp still all-reduces across nodes once per step). DDP always
    defers: it keeps one full gradient per rank whether it syncs or not."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600.0, gt=0)
    """Collective timeout: a lost rank fails the job after this, not after 30 minutes."""
    network: Literal["default", "socket", "infiniband", "wan"] = "default"
    """wan: sites joined by the internet or a slow link. With more than a few MB of gradients per step, pick
    dist.strategy: diloco there, which crosses the link once per diloco.sync_every steps instead of every step."""
    nic: str | None = None
    desync_check_steps: int = Field(100, ge=0)
    """Every N steps DDP replicas compare weight norms (one all-gather); 0 turns it off."""
    desync_tolerance: float = Field(1e-6, ge=0.0)

    @model_validator(mode="after")
    def _shard_size_only_for_hsdp(self) -> "DistConfig":
        if self.shard_size is not None and self.strategy not in ("hsdp", "auto", "diloco"):
            raise ValueError(
                f"dist.shard_size is set but dist.strategy is {self.strategy}: only hsdp has shard groups; "
                "set dist.strategy: hsdp, or remove dist.shard_size"
            )
        return self


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
    _where: dict[str, str] = PrivateAttr(default_factory=dict)
    """Where each field was set ("file:line" or "override 'k=v'"), for errors found after loading."""

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
                f"{_field_and_where(info, 'train.epochs')} counts passes over data.path's rows, but "
                f"{_field_and_where(info, 'data.mixture')} is a stream with no epoch: set train.total_tokens "
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


# ---------------------------------------------------------------- loading


def _field_and_where(info: ValidationInfo, field: str) -> str:
    """`field (file:line)` when the loader passed, as validation context, where each field was set."""
    where = (info.context or {}).get("where")
    return f"{field} ({where(field)})" if where else field

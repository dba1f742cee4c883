"""The data section: the training rows (a file, a built-in task, or a pretraining mixture), how they are rendered,
packed and cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainyard.config.section import Section


SFT_SHAPES = "`messages` or `conversations` (chat), `instruction` + `output` (alpaca) or `text`"
"""The rows train.objective sft learns from: what every data error under sft names."""
PAIR_SHAPES = (
    "`prompt` + `chosen` + `rejected` (strings, or lists of messages), or `chosen` + `rejected` conversations "
    "whose shared first turns are the prompt"
)
"""The preference pairs train.objective dpo learns from: what every data error under dpo names."""


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
    format: Literal["auto", "alpaca", "chat", "text", "preference"] = "auto"
    """auto: what the first row's keys announce. preference: prompt/chosen/rejected pairs (train.objective dpo)."""
    max_length: int = Field(512, ge=8)
    packing: bool = False
    padding_free: bool = True
    """Each micro-batch is one row of its documents back to back, attention kept per document: no padding is
    computed. false: rows padded to the longest in the micro-batch (for models whose attention ignores
    position_ids); packed rows still reach flash-attention as one row (model.collation.one_row)."""
    balance_ranks: bool = True
    """Deal each micro-batch's rows to the data-parallel ranks so each holds about as many tokens (padding-free rows):
    a step waits for its slowest rank, and the loss is normalised over all ranks' tokens, so loss and gradient are the
    same. false: rank r reads the shuffled stream's rows r, r + world, ... (a rank's row count stays fixed)."""
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
        known = sorted(path.stem for path in (Path(__file__).parents[1] / "data" / "templates").glob("*.jinja"))
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

"""A first job file from what a user has (`trainyard init`): a model, a data file, the cluster and the objective.

Every choice is the plan's own: the data read and encoded as the dry run does (its format, its documents' lengths),
the strategy by `plan.auto_strategy` and the fit by `plan.does_not_fit` for the target cluster, the precision by
`plan.precision_on`. Only what differs from the defaults is written, each setting with a one-line comment saying
why, and the text is checked by the dry run before anyone writes it.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import yaml

from trainyard import config_file, estimate, plan, precision
from trainyard import hardware as machines
from trainyard.config import JobConfig
from trainyard.data import survey as data_survey
from trainyard.data.formats import BadRow, detect_format
from trainyard.data.prepare import sources
from trainyard.dist import DistInfo
from trainyard.doctor.preflight import check_source
from trainyard.errors import ModelError, PlanError
from trainyard.estimate.timing import Lengths
from trainyard.model import source as source_room

SURVEY_LENGTH_CAP = 32_768
"""Documents are read up to this many tokens (or the model's context, if shorter) to choose data.max_length."""
SMALLEST_LENGTH = 128
FITTING = ({}, {"model.gradient_checkpointing": True},
           {"model.gradient_checkpointing": True, "train.micro_batch_size": 1})
"""What is tried, cheapest first, until the plan's peak fits the target's devices."""
FITTING_WHY = {"model.gradient_checkpointing": "the plan fits only when each layer's activations are recomputed",
               "train.micro_batch_size": "the plan fits only with one row per micro-batch"}


@dataclass
class Draft:
    """The settings chosen, dotted key -> (value, why), in the order they are written; and what was not planned."""

    settings: dict[str, tuple[Any, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, why: str) -> None:
        self.settings[key] = (value, why)

    def job(self) -> JobConfig:
        """The job these settings make (every other field its default)."""
        nested: dict[str, Any] = {}
        for key, (value, _) in self.settings.items():
            section, _, name = key.rpartition(".")
            (nested.setdefault(section, {}) if section else nested)[name] = value
        return JobConfig.model_validate(nested)


def draft_job(model: str, data: str, target: plan.Target, objective: str = "sft") -> Draft:
    """The settings of a first job for `model` on `data`, planned for `target`."""
    _check_model(model)
    draft = Draft()
    draft.set("run_name", _run_name(model, objective), "names the run folder under output_dir")
    draft.set("model.path", model, _model_words(model))
    if objective != "sft":
        draft.set("train.objective", objective, "preference tuning on chosen/rejected pairs")
    draft.set("data.path", data, "the training rows")
    check_source(Path(data).expanduser(), "DATA", objective=objective)
    lengths = _read_data(draft, objective, target)
    _precision(draft, target)
    _strategy_and_fit(draft, target, lengths)
    return draft


def render(draft: Draft, command: str, check: str) -> str:
    """The job file: a header saying how it was made and how to check it, then each setting with its reason."""
    lines = ["# A first job, written by", f"#   {command}",
             "# with only what differs from the defaults (docs/reference/config.md has every field).",
             "# Check it before the nodes are allocated:", f"#   {check}"]
    lines += [f"# {note}" for note in draft.notes]
    sections: dict[str, list[str]] = {}
    for key, (value, why) in draft.settings.items():
        head, _, name = key.rpartition(".")
        sections.setdefault(head, []).append(f"{'  ' if head else ''}{name}: {_scalar(value)}  # {why}")
    for head, settings in sorted(sections.items(), key=lambda item: item[0] != ""):  # top-level keys first
        lines += ([f"{head}:"] if head else []) + settings
    return "\n".join(lines) + "\n"


def check_with_dry_run(text: str, name: str, target: plan.Target) -> None:
    """The written file must pass `train --dry-run` for its cluster: loaded as a job file, planned as the dry run."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_text(text)
        cfg = config_file.load_config(str(path), [])
        _, problems = plan.dry_run(cfg, target)
    if problems:
        raise PlanError("the job written would not pass its dry run:\n- " + "\n- ".join(problems),
                        fix="choose a larger cluster (--gpu, --gpus-per-node, --nodes) or a smaller model")


def _check_model(model: str) -> None:
    """A local model is a folder with its config.json (or a GGUF file); anything else named like a path is a typo."""
    if source_room.is_hub_id(model) or model in source_room.BUILTIN_MODELS:
        return
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return
    if not path.exists():
        raise ModelError(f"MODEL: {model} does not exist", fix="give a local model folder or a hub id (org/name)")
    if not (path / "config.json").is_file():
        raise ModelError(f"MODEL: {model} has no config.json",
                         fix="point at the folder holding the model's config.json, or give a hub id")


def _run_name(model: str, objective: str) -> str:
    base = re.sub(r"[^a-z0-9.]+", "-", Path(model.rstrip("/")).name.lower()).strip("-.") or "run"
    return f"{base}-{objective}"


def _model_words(model: str) -> str:
    if not source_room.is_hub_id(model):
        return "a local model folder"
    return "a hub id, downloaded into the HF cache on the first run"


def _read_data(draft: Draft, objective: str, target: plan.Target) -> Lengths:
    """data.format and data.max_length from the data itself; its documents' lengths, as the dry run reads them."""
    cfg = draft.job()
    tokenizer, why = source_room.offline_tokenizer(cfg.model)
    if tokenizer is None:
        _set_format(draft, _first_row_format(cfg), "detected from the first row")
        draft.notes.append(f"data.max_length is the default: the rows were not encoded ({why.partition(' (')[0]})")
        return Lengths(batch_why=f"the rows were not encoded: {why}")
    cfg.data.max_length = _length_cap(cfg)
    found = data_survey.survey(cfg, tokenizer)
    _set_format(draft, found.format, f"detected from the rows ({found.usable:,} usable)")
    cuts = data_survey.percentiles(found.documents)
    length = min(max(SMALLEST_LENGTH, 1 << (cuts["p99"] - 1).bit_length()), cfg.data.max_length)
    if length != JobConfig().data.max_length:
        cut = sum(document > length for document in found.documents)
        draft.set("data.max_length", length, f"the data's documents: p99 {cuts['p99']:,} tokens, longest "
                  f"{cuts['max']:,} ({cut:,} cut at this length)")
    return plan.reading.data_lengths(draft.job(), target.world)


def _first_row_format(cfg: JobConfig) -> str:
    rows, _ = sources(cfg.data, cfg.train.objective)
    for where, row in islice(rows, 100):
        if not isinstance(row, BadRow):
            return detect_format(row, where, cfg.train.objective)
    return "auto"


def _set_format(draft: Draft, found: str, why: str) -> None:
    if found != "auto":
        draft.set("data.format", found, why)


def _length_cap(cfg: JobConfig) -> int:
    """The longest document worth reading: the model's context, when this machine knows the model."""
    try:
        config = source_room.architecture(cfg.model, None)
    except ModelError:
        config = None
    context = getattr(config, "max_position_embeddings", None) if config is not None else None
    return min(context or SURVEY_LENGTH_CAP, SURVEY_LENGTH_CAP)


def _precision(draft: Draft, target: plan.Target) -> None:
    cfg = draft.job()
    chosen = plan.precision_on(cfg, target)
    if chosen.name != cfg.train.precision:
        words = precision.describe(chosen, cfg.lora.enabled).rpartition(" (")[0]
        draft.set("train.precision", chosen.name, f"the plan's on {target.gpu}: {words.partition(': ')[2]}")


def _strategy_and_fit(draft: Draft, target: plan.Target, lengths: Lengths) -> None:
    """The strategy the plan picks for the target, with the cheapest changes that make its peak fit; nothing when
    the model is not on this machine (its size is unknown until it is downloaded)."""
    model = plan.meta_model(draft.job())
    if model is None:
        draft.notes.append(f"{draft.settings['model.path'][0]} is not on this machine: the strategy and the fit "
                           "were not planned (the dry run plans them once it is downloaded)")
        return
    info = DistInfo(0, target.world, 0, target.gpus_per_node, torch.device("cpu"), None)
    cluster = estimate.Hardware(target.gpu, target.gpus_per_node, target.nodes)
    for changes in FITTING:
        cfg = draft.job()
        for key, value in changes.items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
        strategy, why = plan.auto_strategy(model, info, cfg, _device_bytes(target), lengths)
        cfg.dist.strategy = strategy
        if plan.does_not_fit(estimate.estimate(cfg, cluster, lengths=lengths, suggest=False)) is None:
            for key, value in changes.items():
                draft.set(key, value, FITTING_WHY[key])
            if target.world > 1:
                draft.set("dist.strategy", strategy, f"the plan's choice for {_cluster(target)}: {why}")
            return
    problem = plan.does_not_fit(estimate.estimate(cfg, cluster, lengths=lengths))  # with the estimate's cheapest fix
    raise PlanError(f"no plan fits {_cluster(target)}, even with gradient checkpointing and one row per "
                    f"micro-batch: {problem}",
                    fix="choose more nodes or a larger GPU (--nodes, --gpu), or a smaller model")


def _device_bytes(target: plan.Target) -> int:
    return machines.device_bytes(machines.gpu(target.gpu), target.gpus_per_node)


def _cluster(target: plan.Target) -> str:
    return f"{target.nodes} x {target.gpus_per_node} {target.gpu}"


def _scalar(value: Any) -> str:
    """One YAML scalar on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()

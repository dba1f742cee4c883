"""Turn a committed checkpoint into a folder that transformers (and PEFT) load directly.

A checkpoint holds only what training changed: the adapter for LoRA jobs, DCP shards for
full fine-tuning. The base comes from the job, so the run dir's `config.yaml` rebuilds it
exactly (same model.path, or the same config and seed). One process, CPU, no process group:
DCP reads shards written by any number of ranks into one plain model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
import transformers
from peft import PeftModel
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from trainyard.atomic import publish_folder, temp_sibling
from trainyard.checkpoint.save import (
    MARKER,
    STEP_DIR,
    check_intact,
    committed,
    committed_kind,
    model_signature,
    newest_intact,
    read_trainer_state,
)
from trainyard.config import JobConfig
from trainyard.config_file import load_config
from trainyard.data.chat import tokenizer_as_trained
from trainyard.errors import CheckpointError, OptionError
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import quantize
from trainyard.model import source as source_room
from trainyard.runs import layout as run_layout


def find_checkpoint(path: Path) -> Path:
    """A committed step folder as given, or a run dir's newest committed full checkpoint; intact either way."""
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist or is not a folder",
            fix="pass a run dir or one of its checkpoints/step-XXXXXXXX folders",
        )
    if STEP_DIR.match(path.name) is None and (path / run_layout.CHECKPOINTS).is_dir():
        newest = newest_intact(path / run_layout.CHECKPOINTS)
        if newest is None:
            damaged = " intact" if committed(path / run_layout.CHECKPOINTS) else ""
            raise CheckpointError(
                f"run dir {path} has no{damaged} committed full checkpoint",
                fix=f"pass one of {path / 'checkpoints'}/step-XXXXXXXX (lite ones too), "
                "or train with checkpoint.at_end: true",
            )
        return newest
    if committed_kind(path) is None:
        raise CheckpointError(
            f"{path} is not a committed checkpoint (no {MARKER} marker: a partial or foreign folder)",
            fix="pass a run dir or a checkpoints/step-XXXXXXXX folder of a finished save",
        )
    check_intact(path)
    return path


def job_of(step: Path) -> JobConfig:
    """The job that wrote a checkpoint, from its run dir's config.yaml."""
    config = step.parent.parent / run_layout.CONFIG
    if not config.is_file():
        raise CheckpointError(
            f"{config} is missing, so the job that wrote {step} is unknown",
            fix="keep checkpoints inside their run dir (run_dir/checkpoints/step-XXXXXXXX)",
        )
    return load_config(str(config))


def training_dtype(cfg: JobConfig, run_dir: Path) -> torch.dtype:
    """The dtype training used: `auto` meant bf16 on GPU, fp32 on CPU (env.json says which)."""
    try:
        device = json.loads((run_dir / run_layout.ENV).read_text()).get("device", "cpu")
    except (OSError, ValueError):
        device = "cpu"
    return source_room.resolve_dtype(cfg.model, torch.device(device))


def frozen_dtype(run_dir: Path) -> torch.dtype | None:
    """The dtype training held its frozen base in (env.json; bf16 under bf16-mixed LoRA on a CPU, whose model dtype
    is fp32), None where the run did not record it."""
    try:
        name = json.loads((run_dir / run_layout.ENV).read_text()).get("frozen_dtype")
    except (OSError, ValueError):
        return None
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def build_base(cfg: JobConfig, dtype: torch.dtype, quantized: torch.dtype | None = None) -> tuple[torch.nn.Module,
                                                                                                   object]:
    """The job's base model and tokenizer, as `trainer.run` builds them before LoRA; an NF4 base as training
    quantized it, in `quantized` (its frozen dtype) where given."""
    model_path = source_room.resolve_model_path(cfg.model) if cfg.model.path is not None else None
    tokenizer = source_room.load_tokenizer(cfg.model, model_path)
    model = model_room.load_model(cfg.model, model_path, tokenizer, dtype, cfg.train.seed)
    if cfg.model.quantize == "nf4":  # the base the adapter trained on: each NF4 weight as training dequantized it
        quantize.round_trip(model, quantize.nf4_targets(model, dtype)[0], quantized)
    return model, tokenizer


def adapter_dir(step: Path) -> Path:
    path = step / "adapter"
    if not (path / "adapter_config.json").is_file():
        raise CheckpointError(
            f"{step} has no adapter/ folder, but the job has lora.enabled: true",
            fix="use the job config that wrote the checkpoint, or another checkpoint of a LoRA run",
        )
    return path


def load_full_weights(model: torch.nn.Module, step: Path) -> None:
    """Read the DCP `model` entries into `model` (plain or wrapped), resharded to this world."""
    if committed_kind(step) != "full":
        raise CheckpointError(
            f"{step} is a {committed_kind(step)} checkpoint, without the full weights this job needs",
            fix="pass a full checkpoint (checkpoint.every_steps or checkpoint.at_end)",
        )
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(step), no_dist=not torch_dist.is_initialized())
    except CheckpointException as err:  # a BaseException: turn it into a user error
        raise CheckpointError(
            f"cannot load model weights from {step}: {err}", fix="pass a checkpoint of this job"
        ) from None
    set_model_state_dict(model, state["model"])


def check_model_matches(model: torch.nn.Module, step: Path) -> None:
    """The rebuilt model must have the parameters the checkpoint was written for."""
    saved = read_trainer_state(step).get("model_signature")
    if saved is not None and saved != model_signature(model):
        raise CheckpointError(
            f"checkpoint {step} was written for another model "
            f"(model_signature {saved}, this job builds {model_signature(model)})",
            fix="use the job config that wrote the checkpoint",
        )


def _prepare_out(out: Path) -> Path:
    """A fresh temp folder beside `out`: a failed export leaves nothing half written."""
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out} is a file", fix="choose a new folder; export writes a model folder")
    if out.exists() and any(out.iterdir()):
        raise OptionError(
            f"--out {out} exists and is not empty",
            fix="choose a new folder, or remove that one first (export never deletes files, so it has no --force)",
        )
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OptionError(f"--out {out}: {blocker} is a file, not a folder", fix="choose a folder path")
    tmp = temp_sibling(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as err:
        raise OptionError(f"--out {out}: cannot create it ({err.strerror})", fix="choose a writable folder") from None
    return tmp


def export(ckpt: Path, out: Path, merge_lora: bool = False) -> Path:
    """Write `out`: a plain HF model folder (+ `adapter/` for unmerged LoRA) and the tokenizer, whose chat template
    is the one the job trained with."""
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
    step = find_checkpoint(ckpt)
    cfg = job_of(step)
    if merge_lora and not cfg.lora.enabled:
        raise OptionError(
            f"--merge-lora: {step} is from a full fine-tuning job (lora.enabled is false)", fix="drop --merge-lora"
        )
    tmp = _prepare_out(out)
    try:
        run_dir = step.parent.parent
        model, tokenizer = build_base(cfg, training_dtype(cfg, run_dir), frozen_dtype(run_dir))
        if cfg.lora.enabled:
            _export_lora(model, step, tmp, merge_lora, with_base=cfg.model.quantize == "none")
        else:
            check_model_matches(model, step)
            load_full_weights(model, step)
            model.save_pretrained(tmp)
        tokenizer_as_trained(tokenizer, cfg.data).save_pretrained(tmp)  # the chat template as training rendered it
        if not publish_folder(tmp, out):
            raise OptionError(f"--out {out} was filled by another process meanwhile", fix="choose a new folder")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _export_lora(base: torch.nn.Module, step: Path, out: Path, merge: bool, with_base: bool = True) -> None:
    """Merged: one plain model. Unmerged: the base, and the adapter PEFT loads onto it; under model.quantize the
    adapter alone (its base is model.path, quantized again by whoever loads it: no copy of it in full precision)."""
    if not merge and with_base:
        base.save_pretrained(out)  # before PEFT injects its layers into the same modules
    with lora_room.known_peft_warnings_ignored():
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir(step)))
    if merge:
        peft_model.merge_and_unload().save_pretrained(out)
    else:
        peft_model.save_pretrained(out / "adapter")

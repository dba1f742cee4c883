"""`trainyard eval`: score a committed checkpoint on the job's eval set, on any world size.

The model is built, wrapped and loaded as `trainer.run` does it; LoRA jobs then read the
checkpoint's adapter into each rank's adapter shards, full fine-tuning jobs read the DCP model
shards into the wrapped model (both reshard, so the world size need not match training's).
Then one call to `evaluate.evaluate`: the fixed subset, one all-reduce.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import transformers

from trainyard import dist, precision
from trainyard.checkpoint.export import adapter_dir, check_model_matches, find_checkpoint, load_full_weights
from trainyard.config import JobConfig
from trainyard.data import prepare_datasets
from trainyard.errors import DataError
from trainyard.evaluate import evaluate
from trainyard.model import collation
from trainyard.model import source as source_room
from trainyard.config.preference import REFERENCE_FREE
from trainyard.model import weights
from trainyard.parallel.parallelize import unwrap
from trainyard.preference.reference import attach_reference
from trainyard.train.build import build_and_wrap


def evaluate_checkpoint(cfg: JobConfig, checkpoint: Path) -> dict[str, object]:
    """Loss, perplexity (and exact match with eval.generate) of a checkpoint's weights."""
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    step = find_checkpoint(checkpoint)
    info = dist.init(cfg.dist, nic_where=cfg.where("dist.nic"))
    log = logging.getLogger("trainyard").info
    model_source = source_room.fetch_hub_model(cfg.model)  # before any collective: a download outlasts its timeout
    model_path = None
    with dist.first_on_node(info):
        if model_source.path is not None:
            model_path = source_room.resolve_model_path(model_source)
        tokenizer = source_room.load_tokenizer(model_source, model_path)
    cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / ".cache" / "data"
    data = prepare_datasets(cfg.data, tokenizer, cache_root, log=log, objective=cfg.train.objective)
    if data.eval is None or len(data.eval) == 0:
        raise DataError(
            f"the job has no eval set (data.path {cfg.data.path})",
            fix="set data.eval_path, or data.eval_fraction to hold out part of data.path",
        )
    used = precision.resolve(cfg, info.device)
    model, _, _ = build_and_wrap(cfg, info, used, model_path, tokenizer, forward_only=True)

    def autocast():  # type: ignore[no-untyped-def]
        return precision.autocast(used, info.device, enabled=not dist.is_fsdp(model))

    dpo = cfg.dpo if cfg.train.objective == "dpo" else None
    if dpo is not None and not cfg.lora.enabled and dpo.loss not in REFERENCE_FREE:
        attach_reference(cfg, data, model, info, used, autocast, log)  # the initial weights, before the checkpoint's
    if cfg.lora.enabled:
        weights.load_adapter(model, adapter_dir(step) / "adapter_model.safetensors")
    else:
        check_model_matches(model, step)
        load_full_weights(model, step)
    figures = evaluate(
        model,
        data.eval,
        subset_size=cfg.eval.subset_size,
        seed=cfg.eval.seed,
        batch_size=cfg.eval.batch_size,
        info=info,
        tokenizer=tokenizer,
        generate=cfg.eval.generate,
        max_new_tokens=cfg.eval.max_new_tokens,
        autocast=autocast,
        padding_free=collation.model_one_row(unwrap(model), cfg.data),
        dpo=dpo,
    )
    dist.teardown()
    return {"checkpoint": str(step), **figures}


def format_figures(figures: dict[str, object]) -> str:
    """One `name value` line per figure, full precision: easy to read and to parse."""
    return "\n".join(f"{name} {value}" for name, value in figures.items())

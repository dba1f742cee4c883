"""The training recipe, top to bottom, and the explicit loop.

`run` is the whole job in the order DESIGN.md draws it; `fit` is the loop: gather one
accumulation window, count its target tokens across ranks with one all-reduce, run
forward/backward with gradient sync only on the last micro-batch, clip, step, log, and
at their intervals evaluate and checkpoint.
"""

from __future__ import annotations

import math
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import peft
import torch
import torch.distributed as torch_dist
import transformers

from trainyard import checkpoint, dist, model as model_room, parallel
from trainyard.config import JobConfig, accumulation_steps, dump_config
from trainyard.data import PreparedData, ResumableSampler, micro_batches, prepare_datasets
from trainyard.errors import TrainyardError
from trainyard.evaluate import evaluate, token_loss_sum
from trainyard.metrics import MetricsSink, flops_per_token, peak_memory_bytes, setup_logging, write_json


class NonFiniteError(TrainyardError):
    exit_code = 1


@dataclass
class LoopState:
    step: int = 0
    tokens: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    baseline_eval: dict[str, float] = field(default_factory=dict)
    steady_tokens: int = 0
    steady_time: float = 0.0


def lr_lambda(cfg: JobConfig):
    """Linear warmup, then cosine / linear decay to min_lr_ratio, or constant."""
    train = cfg.train

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        if train.schedule == "constant":
            return 1.0
        progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
        progress = min(progress, 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if train.schedule == "cosine" else 1 - progress
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * shape

    return factor


def build_optimizer(model: torch.nn.Module, cfg: JobConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Total gradient norm over all ranks (DTensor-aware), clipped when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor else norm


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: Any,
    cfg: JobConfig,
    info: dist.DistInfo,
    accum: int,
    sink: MetricsSink,
    data: PreparedData,
    tokenizer: Any,
    flops_token: float,
) -> LoopState:
    state = LoopState()
    interval = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss sum, targets, real tokens
    interval_time = 0.0  # training time only: eval and checkpoints do not dilute tokens/s
    run_eval = _evaluator(model, cfg, info, data, tokenizer)
    if cfg.eval.baseline and run_eval:
        state.baseline_eval = run_eval()
        sink.emit("eval", step=0, baseline=True, **state.baseline_eval)
    model.train()
    for step in range(1, cfg.train.max_steps + 1):
        step_start = time.monotonic()
        window = [next(batches) for _ in range(accum)]
        data_wait = time.monotonic() - step_start
        counts = torch.tensor(
            [sum(int((b["labels"][:, 1:] != -100).sum()) for b in window), sum(int(b.pop("real_tokens")) for b in window)],
            dtype=torch.float64,
            device=info.device,
        )
        dist.all_reduce_sum(counts)  # the one collective of the step outside DDP/FSDP
        global_targets, global_real = counts.tolist()
        # DDP/FSDP average gradients over ranks; multiplying back by world makes the
        # gradient that of the summed loss over every target token in the global batch.
        scale = info.world_size / max(global_targets, 1.0)
        for i, batch in enumerate(window):
            batch = {k: v.to(info.device) for k, v in batch.items()}
            with parallel.gradient_sync(model, enabled=i == accum - 1):
                loss_sum, _ = token_loss_sum(model, batch)
                (loss_sum * scale).backward()
            interval[0] += loss_sum.detach().double()
        interval[1] += counts[0]
        interval[2] += counts[1]
        grad_norm = grad_norm_and_clip(model, cfg.train.max_grad_norm)
        if not torch.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            if cfg.train.on_nonfinite == "error":
                raise NonFiniteError(
                    f"non-finite gradient norm at step {step} (rank {info.rank} saw {grad_norm.item()})",
                    fix="lower train.lr, check the data, or set train.on_nonfinite: skip",
                )
            sink.emit("system", step=step, event="skipped_nonfinite_step")
            continue
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.monotonic() - step_start
        state.step = step
        state.tokens += int(global_real)
        if step > 1:
            state.steady_tokens += int(global_real)
            state.steady_time += step_time
        interval_time += step_time
        if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:
            _log_interval(state, sink, interval, interval_time, info, step, lr, grad_norm, data_wait / step_time, flops_token)
            interval.zero_()
            interval_time = 0.0
        if run_eval and cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
            state.last_eval = run_eval()
            sink.emit("eval", step=step, **state.last_eval)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
            _save_lite(model, cfg, info, sink, step)
    if run_eval and cfg.eval.at_end and not (cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0):
        state.last_eval = run_eval()
        sink.emit("eval", step=state.step, **state.last_eval)
    if cfg.checkpoint.at_end and not (cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0):
        _save_lite(model, cfg, info, sink, state.step)
    return state


def _log_interval(
    state: LoopState,
    sink: MetricsSink,
    interval: torch.Tensor,
    elapsed: float,
    info: dist.DistInfo,
    step: int,
    lr: float,
    grad_norm: torch.Tensor,
    data_wait_share: float,
    flops_token: float,
) -> None:
    loss_sum = dist.all_reduce_sum(interval[:1].clone())  # targets and real tokens are already global
    loss = (loss_sum[0] / interval[1].clamp(min=1)).item()
    tokens_per_s = interval[2].item() / max(elapsed, 1e-9)
    state.first_loss = loss if state.first_loss is None else state.first_loss
    state.last_loss = loss
    sink.emit(
        "train",
        step=step,
        loss=loss,
        lr=lr,
        grad_norm=float(grad_norm),
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_rank=tokens_per_s / info.world_size,
        achieved_flops_per_rank=tokens_per_s * flops_token / info.world_size,
        data_wait_share=data_wait_share,
        peak_memory_bytes=peak_memory_bytes(info.device),
        tokens=state.tokens,
    )


def _evaluator(model: torch.nn.Module, cfg: JobConfig, info: dist.DistInfo, data: PreparedData, tokenizer: Any):
    if data.eval is None or len(data.eval) == 0:
        return None

    def run_eval() -> dict[str, float]:
        return evaluate(
            model,
            data.eval,
            subset_size=cfg.eval.subset_size,
            seed=cfg.eval.seed,
            batch_size=cfg.eval.batch_size,
            info=info,
            tokenizer=tokenizer,
            generate=cfg.eval.generate,
            max_new_tokens=cfg.eval.max_new_tokens,
        )

    return run_eval


def _save_lite(model: torch.nn.Module, cfg: JobConfig, info: dist.DistInfo, sink: MetricsSink, step: int) -> None:
    started = time.monotonic()
    path = checkpoint.save_adapter(model, cfg.run_dir / "checkpoints" / f"step-{step:08d}" / "adapter", info)
    if path is not None:
        sink.emit("checkpoint", step=step, mode="lite", path=str(path), seconds=time.monotonic() - started)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _environment(info: dist.DistInfo) -> dict[str, Any]:
    hosts: list[Any] = [dist.host_summary(info)]
    if info.distributed:
        hosts = [None] * info.world_size
        torch_dist.all_gather_object(hosts, dist.host_summary(info))
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "datasets": datasets.__version__,
        "world_size": info.world_size,
        "device": str(info.device.type),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "hosts": hosts,
        "git_commit": _git_commit(),
    }


def run(cfg: JobConfig) -> dict[str, Any]:
    """The whole job: init, data, model, wrap, fit, summary. Every rank runs it."""
    wall_start = time.monotonic()
    info = dist.init(cfg.dist)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(run_dir, info)
    network = dist.apply_network_preset(cfg.dist)
    if info.is_main:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        logger.info("run dir %s  world %d  device %s  network %s", run_dir, info.world_size, info.device, network or "default")
    environment = _environment(info)
    if info.is_main:
        write_json(run_dir / "env.json", environment)

    model_path = None
    with dist.first_on_node(info):  # one process per node converts/loads caches first
        if cfg.model.path is not None:
            model_path = model_room.resolve_model_path(cfg.model)
        tokenizer = model_room.load_tokenizer(cfg.model, model_path)
    cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / ".cache" / "data"
    data = prepare_datasets(cfg.data, tokenizer, cache_root, log=logger.info)

    dtype = model_room.resolve_dtype(cfg.model, info.device)
    model = model_room.load_model(cfg.model, model_path, tokenizer, dtype, cfg.train.seed)
    if cfg.lora.enabled:
        model = model_room.apply_lora(model, cfg.lora, cfg.train.seed)
        model.to(dtype)
    if cfg.model.gradient_checkpointing:
        model_room.enable_activation_checkpointing(model)
    total_params, trainable_params = model_room.parameter_counts(model)
    strategy = parallel.choose_strategy(cfg.dist.strategy, model, info)
    model = parallel.wrap(model, strategy, info)
    accum = accumulation_steps(cfg, info.world_size)
    logger.info(
        "strategy %s  accumulation %d  params %s (trainable %s)  dtype %s",
        strategy, accum, f"{total_params:,}", f"{trainable_params:,}", dtype,
    )

    torch.manual_seed(cfg.train.seed + info.rank)  # dropout differs per rank, data order does not
    sampler = ResumableSampler(len(data.train), seed=cfg.train.seed, rank=info.rank, world_size=info.world_size)
    batches = micro_batches(data.train, sampler, cfg.train.micro_batch_size, tokenizer.pad_token_id)
    optimizer, scheduler = build_optimizer(model, cfg)
    hf_config = parallel.unwrap(model).config
    flops_token = flops_per_token(
        total_params, trainable_params, hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.max_length
    )
    sink = MetricsSink(cfg, info, logger)
    try:
        state = fit(model, optimizer, scheduler, batches, cfg, info, accum, sink, data, tokenizer, flops_token)
    finally:
        sink.close()
    summary = {
        "wall_time_s": time.monotonic() - wall_start,
        "steps": state.step,
        "tokens": state.tokens,
        "tokens_per_s": state.steady_tokens / state.steady_time if state.steady_time else None,
        "tokens_per_s_per_rank": state.steady_tokens / state.steady_time / info.world_size if state.steady_time else None,
        "world_size": info.world_size,
        "strategy": strategy,
        "accumulation": accum,
        "device": environment["cuda_devices"][0] if environment["cuda_devices"] else "cpu",
        "torch": torch.__version__,
        "model": cfg.model.path or f"config:{cfg.model.config.get('model_type') if cfg.model.config else None}",
        "dataset": cfg.data.path,
        "data_fingerprint": data.fingerprint,
        "data_stats": data.stats,
        "params": total_params,
        "trainable_params": trainable_params,
        "first_train_loss": state.first_loss,
        "final_train_loss": state.last_loss,
        "final_eval_loss": state.last_eval.get("eval_loss"),
        "final_eval_accuracy": state.last_eval.get("eval_accuracy"),
        "baseline_eval_loss": state.baseline_eval.get("eval_loss"),
        "baseline_eval_accuracy": state.baseline_eval.get("eval_accuracy"),
    }
    if info.is_main:
        write_json(run_dir / "summary.json", summary)
    dist.teardown()
    return summary

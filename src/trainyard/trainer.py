"""The training recipe, top to bottom, and the explicit loop.

`run` is the whole job in the order DESIGN.md draws it; `fit` is the loop: gather one
accumulation window, count its target tokens across ranks with one all-reduce, run
forward/backward with gradient sync only on the last micro-batch, clip, step, log, and
at their intervals evaluate and checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import transformers
from torch.distributed.fsdp import FSDPModule

from trainyard import checkpoint, dist, health, model as model_room, parallel
from trainyard.config import JobConfig, accumulation_steps, dump_config
from trainyard.data import PreparedData, ResumableSampler, micro_batches, prepare_datasets
from trainyard.errors import CheckpointError, TrainyardError
from trainyard.evaluate import evaluate, token_loss_sum
from trainyard.metrics import MetricsSink, device_peak_flops, environment_record, flops_per_token, peak_memory_bytes, setup_logging, write_json
from trainyard.status import BackgroundHeartbeat


class NonFiniteError(TrainyardError):
    exit_code = 1


class Preempted(TrainyardError):
    """Stopped by a preemption signal after a checkpoint was committed: requeue me."""
    exit_code = 75


_SIGNALLED: list[str] = []


def install_preemption_handlers(names: list[str]) -> None:
    """Only note the signal: every rank agrees at the next step boundary, then saves."""
    for name in names:
        signal.signal(getattr(signal, name), lambda signum, _frame: _SIGNALLED.append(signal.Signals(signum).name))


@dataclass
class LoopState:
    """Everything about the loop's progress a checkpoint must carry for an exact resume."""

    step: int = 0
    tokens: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    baseline_eval: dict[str, float] = field(default_factory=dict)
    steady_tokens: int = 0
    steady_time: float = 0.0


@dataclass
class Job:
    """What the loop works on, built once by `run`."""

    cfg: JobConfig
    info: dist.DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ResumableSampler
    data: PreparedData
    tokenizer: Any
    sink: MetricsSink
    accum: int
    flops_token: float
    facts: dict[str, Any]
    """What a checkpoint must match to be resumed by this job (see checkpoint.check_compatible)."""
    checkpoint_group: Any = None
    resumed_from: Path | None = None
    comm_timer: parallel.CommTimer | None = None

    @property
    def checkpoints(self) -> Path:
        return self.cfg.run_dir / "checkpoints"


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


# Slots of the step's one all-reduce: token counts for the loss normalisation, and flags every
# rank must agree on (async save done/failed here, a preemption signal, a timed save due).
TARGETS, REAL, SAVE_DONE, SAVE_FAILED, PREEMPT, TIMED = range(6)


def fit(job: Job, batches: Any, state: LoopState) -> LoopState:
    cfg, info, model = job.cfg, job.info, job.model
    interval = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss sum, targets, real tokens
    run_eval = _evaluator(job)
    if cfg.eval.baseline and run_eval and state.step == 0:
        state.baseline_eval = run_eval()
        job.sink.emit("eval", step=0, baseline=True, **state.baseline_eval)
    heartbeat = BackgroundHeartbeat(cfg.run_dir, info.rank)
    heartbeat.step = state.step
    heartbeat.start()
    model.train()
    try:
        pending = _train_steps(job, batches, state, run_eval, heartbeat, interval)
    except RuntimeError as err:
        if info.distributed and health.looks_like_comm_failure(err):
            raise health.explain_comm_failure(err, info, cfg.run_dir, state.step + 1, cfg.dist.timeout_s) from None
        raise
    heartbeat.step = state.step
    heartbeat.stop()
    if run_eval and cfg.eval.at_end and not (cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0):
        state.last_eval = run_eval()
        job.sink.emit("eval", step=state.step, **state.last_eval)
    if cfg.checkpoint.at_end:
        _save_full(job, state, pending, async_save=False)
    elif pending is not None:
        _settle(job, pending, failed=False, wait=True)
    return state


def _train_steps(job: Job, batches: Any, state: LoopState, run_eval: Any, heartbeat: BackgroundHeartbeat, interval: torch.Tensor) -> checkpoint.PendingSave | None:
    """Steps until max_steps; returns the save still in flight, if any."""
    cfg, info, model = job.cfg, job.info, job.model
    interval_time = 0.0  # training time only: eval and checkpoints do not dilute tokens/s
    pending: checkpoint.PendingSave | None = None
    last_full = time.monotonic()
    for step in range(state.step + 1, cfg.train.max_steps + 1):
        step_start = time.monotonic()
        position = job.sampler.state_dict()  # where this step's data starts: a preemption save resumes here
        window = [next(batches) for _ in range(job.accum)]
        data_wait = time.monotonic() - step_start
        control = torch.zeros(6, dtype=torch.float64, device=info.device)
        control[TARGETS] = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        control[REAL] = sum(int(b.pop("real_tokens")) for b in window)
        control[SAVE_DONE] = float(pending is not None and pending.done_here() and not _failed(pending))
        control[SAVE_FAILED] = float(pending is not None and _failed(pending))
        control[PREEMPT] = float(bool(_SIGNALLED))
        control[TIMED] = float(info.is_main and cfg.checkpoint.every_minutes > 0 and time.monotonic() - last_full > cfg.checkpoint.every_minutes * 60)
        health.record_progress(info, step, health.CONTROL)
        dist.all_reduce_sum(control)  # the one collective of the step outside DDP/FSDP
        if pending is not None and (control[SAVE_FAILED] > 0 or control[SAVE_DONE] == info.world_size):
            pending = _settle(job, pending, failed=control[SAVE_FAILED] > 0)
        if control[PREEMPT] > 0:
            job.sampler.load_state_dict(position)  # the window drawn above is never trained on
            _save_full(job, state, pending, async_save=False)
            raise Preempted(
                f"preempted by {(_SIGNALLED or ['a signal on another rank'])[0]} after step {state.step}; "
                f"checkpoint step-{state.step:08d} committed",
                fix="run the same command again to resume",
            )
        # DDP/FSDP average gradients over ranks; multiplying back by world makes the
        # gradient that of the summed loss over every target token in the global batch.
        scale = info.world_size / max(control[TARGETS].item(), 1.0)
        step_loss = torch.zeros((), dtype=torch.float64, device=info.device)
        for i, batch in enumerate(window):
            batch = {k: v.to(info.device) for k, v in batch.items()}
            with parallel.gradient_sync(model, enabled=i == job.accum - 1):
                loss_sum, _ = token_loss_sum(model, batch)
                if health.injected("nan", info, step):
                    loss_sum = loss_sum * float("nan")
                if i == job.accum - 1:
                    health.record_progress(info, step, health.GRAD_SYNC)
                (loss_sum * scale).backward()
            step_loss += loss_sum.detach().double()
        interval[0] += step_loss
        interval[1] += control[TARGETS]
        interval[2] += control[REAL]
        health.record_progress(info, step, health.REPORT)  # clipping and logging gather next
        grad_norm = grad_norm_and_clip(model, cfg.train.max_grad_norm)
        if not torch.isfinite(grad_norm):  # the norm is global: every rank takes this branch
            job.optimizer.zero_grad(set_to_none=True)
            culprits = health.flagged_ranks(not bool(torch.isfinite(step_loss)), info)
            if cfg.train.on_nonfinite == "error":
                raise NonFiniteError(
                    f"non-finite loss or gradient at step {step}: "
                    + (f"the loss was non-finite on rank(s) {culprits}" if culprits else f"gradient norm {grad_norm.item()}, losses finite"),
                    fix="lower train.lr, check that rank's data, or set train.on_nonfinite: skip",
                )
            job.sink.emit("system", step=step, event="skipped_nonfinite_step", ranks=culprits)
            continue
        lr = job.scheduler.get_last_lr()[0]
        job.optimizer.step()
        job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
        if cfg.dist.desync_check_steps and step % cfg.dist.desync_check_steps == 0 and info.distributed and not isinstance(model, FSDPModule):
            if health.injected("desync", info, step):
                health.corrupt_one_parameter(model)
            health.check_replicas_agree(model, info, step, cfg.dist.desync_tolerance)
        step_time = time.monotonic() - step_start
        state.step = step
        state.tokens += int(control[REAL].item())
        if step > 1:
            state.steady_tokens += int(control[REAL].item())
            state.steady_time += step_time
        interval_time += step_time
        heartbeat.step = step
        if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:
            _log_interval(state, job, interval, interval_time, lr, grad_norm, data_wait / step_time)
            interval.zero_()
            interval_time = 0.0
        if run_eval and cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
            state.last_eval = run_eval()
            job.sink.emit("eval", step=step, **state.last_eval)
        full_due = (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or control[TIMED] > 0
        if full_due and step < cfg.train.max_steps:
            pending = _save_full(job, state, pending, async_save=cfg.checkpoint.async_save)
            last_full = time.monotonic()
        elif cfg.checkpoint.lite_every_steps and step % cfg.checkpoint.lite_every_steps == 0:
            _save_lite(job, step)
    return pending


def _failed(pending: checkpoint.PendingSave) -> bool:
    return pending.future is not None and pending.future.done() and pending.future.exception() is not None


def _settle(job: Job, pending: checkpoint.PendingSave, failed: bool, wait: bool = False) -> None:
    """Commit a finished background save, or report the failed one (never silently missing)."""
    try:
        if wait:
            checkpoint.finish_save(pending)
            dist.barrier()
        if failed:
            checkpoint.finish_save(pending)  # raises with this rank's error
            raise CheckpointError(f"writing checkpoint {pending.path} failed on another rank", fix="see the logs of every rank")
    except CheckpointError as err:
        return _checkpoint_failed(job, pending.step, err)
    _commit_full(job, pending)


def _commit_full(job: Job, pending: checkpoint.PendingSave, **figures: float) -> None:
    checkpoint.commit(job.checkpoints, pending.path, "full", job.info)
    if job.info.is_main:
        removed = checkpoint.rotate(job.checkpoints, job.cfg.checkpoint.keep_last, job.resumed_from)
        job.sink.emit(
            "checkpoint", step=pending.step, mode="full", path=str(pending.path), committed=True,
            removed=[p.name for p in removed], **figures,
        )


def _checkpoint_failed(job: Job, step: int, err: CheckpointError) -> None:
    job.sink.emit("system", step=step, event="checkpoint_failed", error=err.what)
    logging.getLogger("trainyard").error("checkpoint at step %d failed: %s", step, err.what)
    if job.cfg.checkpoint.on_error == "stop":
        raise err


def _save_full(job: Job, state: LoopState, pending: checkpoint.PendingSave | None, async_save: bool) -> checkpoint.PendingSave | None:
    """At most one save in flight: the previous one is finished and committed first."""
    if pending is not None:
        _settle(job, pending, failed=False, wait=True)
    path = checkpoint.step_dir(job.checkpoints, state.step)
    if checkpoint.committed_kind(path) == "full":
        return None  # this step is already saved (a preemption right after a save)
    started = time.monotonic()
    trainer_state = {
        "step": state.step,
        "world_size": job.info.world_size,
        "scheduler": job.scheduler.state_dict(),
        "loop": asdict(state),
        **job.facts,
    }
    rank_state = {"sampler": job.sampler.state_dict(), "rng": checkpoint.rng_state()}
    try:
        new = checkpoint.start_full_save(
            job.model, job.optimizer, path, trainer_state=trainer_state, rank_state=rank_state, info=job.info,
            async_save=async_save, save_frozen=job.cfg.checkpoint.save_frozen, process_group=job.checkpoint_group,
        )
    except (OSError, RuntimeError) as err:
        _checkpoint_failed(job, state.step, CheckpointError(
            f"saving checkpoint {path} failed: {err}",
            fix="check free space and permissions of the checkpoint dir; the previous checkpoint is intact",
        ))
        return None
    stall = time.monotonic() - started
    if async_save:
        job.sink.emit("checkpoint", step=state.step, mode="full", path=str(path), async_save=True, stall_s=stall)
        return new
    _commit_full(job, new, stall_s=stall)
    return None


def _log_interval(
    state: LoopState, job: Job, interval: torch.Tensor, elapsed: float, lr: float, grad_norm: torch.Tensor, data_wait_share: float
) -> None:
    # One all-gather: loss sums to add up, and each rank's busy time to spot stragglers.
    mine = torch.stack([interval[0], torch.tensor(elapsed, dtype=torch.float64, device=interval.device)])
    every = dist.all_gather_rows(mine)
    loss = (every[:, 0].sum() / interval[1].clamp(min=1)).item()
    times = every[:, 1]
    median = times.median().item()
    stragglers = [r for r, t in enumerate(times.tolist()) if median > 0 and t > 1.2 * median]
    tokens_per_s = interval[2].item() / max(elapsed, 1e-9)
    world = job.info.world_size
    state.first_loss = loss if state.first_loss is None else state.first_loss
    state.last_loss = loss
    job.sink.emit(
        "train",
        step=state.step,
        loss=loss,
        lr=lr,
        grad_norm=float(grad_norm),
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_rank=tokens_per_s / world,
        achieved_flops_per_rank=tokens_per_s * job.flops_token / world,
        mfu=tokens_per_s * job.flops_token / world / peak if (peak := device_peak_flops(job.info.device)) else None,
        data_wait_share=data_wait_share,
        step_time_spread=(times.max() - times.min()).item() / max(median, 1e-9),
        comm_share=job.comm_timer.take() / max(elapsed, 1e-9) if job.comm_timer else None,
        stragglers=stragglers,
        peak_memory_bytes=peak_memory_bytes(job.info.device),
        tokens=state.tokens,
    )


def _evaluator(job: Job):
    cfg = job.cfg
    if job.data.eval is None or len(job.data.eval) == 0:
        return None

    def run_eval() -> dict[str, float]:
        return evaluate(
            job.model,
            job.data.eval,
            subset_size=cfg.eval.subset_size,
            seed=cfg.eval.seed,
            batch_size=cfg.eval.batch_size,
            info=job.info,
            tokenizer=job.tokenizer,
            generate=cfg.eval.generate,
            max_new_tokens=cfg.eval.max_new_tokens,
        )

    return run_eval


def _save_lite(job: Job, step: int) -> None:
    started = time.monotonic()
    path = checkpoint.save_lite(job.model, job.checkpoints, step, job.info)
    if path is not None:
        job.sink.emit("checkpoint", step=step, mode="lite", path=str(path / "adapter"), stall_s=time.monotonic() - started)


def resume(job: Job) -> LoopState:
    """Clean partial saves, then load the checkpoint `checkpoint.resume` names (or start fresh)."""
    logger = logging.getLogger("trainyard")
    if job.info.is_main:
        for partial in checkpoint.remove_uncommitted(job.checkpoints):
            logger.info("removed partial checkpoint %s (no commit marker)", partial)
    dist.barrier()
    path = checkpoint.resolve_resume(job.cfg.checkpoint.resume, job.checkpoints)
    if path is None:
        logger.info("starting fresh (checkpoint.resume: %s, no committed checkpoint)", job.cfg.checkpoint.resume)
        return LoopState()
    saved = checkpoint.read_trainer_state(path)
    checkpoint.check_compatible(saved, job.facts, path)
    rank_state = checkpoint.load_full(job.model, job.optimizer, path, job.info, job.cfg.checkpoint.save_frozen)
    job.scheduler.load_state_dict(saved["scheduler"])
    sampler_state = dict(rank_state["sampler"])
    if saved["world_size"] == job.info.world_size:
        checkpoint.set_rng_state(rank_state["rng"])
    else:  # same samples consumed in total, spread over the new number of ranks
        sampler_state["index"] = sampler_state["index"] * saved["world_size"] // job.info.world_size
    job.sampler.load_state_dict(sampler_state)
    job.resumed_from = path
    logger.info("resumed from %s at step %d", path, saved["step"])
    job.sink.emit("system", step=saved["step"], event="resumed", path=str(path), saved_world_size=saved["world_size"])
    return LoopState(**saved["loop"])


def run(cfg: JobConfig) -> dict[str, Any]:
    """The whole job: init, data, model, wrap, fit, summary. Every rank runs it."""
    wall_start = time.monotonic()
    transformers.utils.logging.disable_progress_bar()  # our own progress line is the only one
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    info = dist.init(cfg.dist)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(run_dir, info)
    network = dist.apply_network_preset(cfg.dist)
    if info.is_main:
        logger.info("run dir %s  world %d  device %s  network %s", run_dir, info.world_size, info.device, network or "default")
    environment = environment_record(info)
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
    optimizer, scheduler = build_optimizer(model, cfg)
    hf_config = parallel.unwrap(model).config
    job = Job(
        cfg=cfg, info=info, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler, data=data,
        tokenizer=tokenizer, sink=MetricsSink(cfg, info, logger), accum=accum,
        flops_token=flops_per_token(total_params, trainable_params, hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.max_length),
        facts={
            "model_signature": checkpoint.model_signature(model),
            "lora": cfg.lora.model_dump(mode="json") if cfg.lora.enabled else None,
            "data_fingerprint": data.fingerprint,
            "global_batch_samples": cfg.train.micro_batch_size * accum * info.world_size,
        },
        checkpoint_group=torch_dist.new_group(backend="gloo") if info.distributed and cfg.checkpoint.async_save else None,
    )
    job.comm_timer = parallel.attach_comm_timer(model)
    state = resume(job)
    if info.is_main:  # after resume's checks: a rejected job never replaces the run's config
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    install_preemption_handlers(cfg.checkpoint.preemption_signals)
    batches = micro_batches(data.train, sampler, cfg.train.micro_batch_size, tokenizer.pad_token_id)
    try:
        state = fit(job, batches, state)
    finally:
        job.sink.close()
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

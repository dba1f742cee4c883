"""The training recipe, top to bottom, and the explicit loop.

`run` is the whole job in the order DESIGN.md draws it; `fit` is the loop: gather one
accumulation window, count its target tokens across ranks (a DiLoCo site's) with one all-reduce (votes.py), run
forward/backward (gradients reduced as `parallel.gradient_sync` says), clip, step, log,
and at their intervals evaluate and checkpoint. When a full save is due, what it holds, resuming and
preemption are loop_state.py's.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

from trainyard import dist, health
from trainyard import precision as precision_room
from trainyard.atomic import write_atomically
from trainyard.batch import accumulation_steps, steps_for_epochs
from trainyard.checkpoint import save as checkpoint
from trainyard.config import JobConfig
from trainyard.config_file import dump_config
from trainyard.data import ResumableSampler, micro_batches, prepare_datasets, sample_record_path
from trainyard.data.chat import tokenizer_as_trained
from trainyard.data.loader import largest_rows, stream_batches
from trainyard.data.mixture import MixtureStream, mixture_stream
from trainyard.data.token_batches import StepWindows, accumulation_windows, token_windows
from trainyard.data.pretraining import prepare_pretraining
from trainyard.diloco import ft as diloco_ft
from trainyard.diloco import outer as diloco
from trainyard.errors import NonFiniteError
from trainyard.evaluate import evaluate, samples_file
from trainyard.hardware import device_peak_flops, flop_shape
from trainyard.launch import allocator, title
from trainyard.metrics import (
    LogWindow,
    MetricsSink,
    environment_record,
    memory_reading,
    setup_logging,
    write_json,
)
from trainyard.model import collation
from trainyard.model import build as model_room
from trainyard.model import routing
from trainyard.model import source as source_room
from trainyard.objective import build_objective
from trainyard.parallel import comm, context_parallel, expert_parallel
from trainyard.parallel import parallelize as parallel
from trainyard.plan import batching as plan_batching
from trainyard.runs import layout as run_layout
from trainyard.runs.status import BackgroundHeartbeat
from trainyard.train import build, events, oom, rounds
from trainyard.train import state as loop_state
from trainyard.train import votes as agreement
from trainyard.train.job import Job
from trainyard.train.optim import build_optimizer, grad_norm_and_clip
from trainyard.train.state import LoopState


def fit(job: Job, windows: StepWindows, state: LoopState) -> LoopState:
    cfg, info, model = job.cfg, job.info, job.model
    routers = routing.find_routers(model)
    interval = LogWindow(info.device, job.comm_timer, device_peak_flops(info.device, job.precision.compute_dtype),
                         routing.ExpertLoad(routers, info.device) if routers else None, job.objective.figures)
    interval.memory_trend.start_step = state.step  # a resumed process settles in like a fresh one
    run_eval = _evaluator(job)
    if cfg.eval.baseline and run_eval and state.step == 0:
        state.baseline_eval = run_eval(0)
        job.sink.emit("eval", step=0, baseline=True, **state.baseline_eval)
    heartbeat = BackgroundHeartbeat(cfg.run_dir, info.rank)
    heartbeat.step = state.step
    heartbeat.start()
    model.train()
    try:
        _train_steps(job, windows, state, run_eval, heartbeat, interval)
    except RuntimeError as err:
        if info.distributed and health.looks_like_comm_failure(err):
            step, timeout_s = state.step + 1, cfg.dist.timeout_s
            raise health.explain_comm_failure(err, info, cfg.run_dir, step, timeout_s) from None
        raise
    finally:  # a preemption or an error included: the last beat says where this rank stopped
        heartbeat.step = state.step
        heartbeat.stop()
    if run_eval and cfg.eval.at_end and not (cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0):
        state.last_eval = run_eval(state.step)
        job.sink.emit("eval", step=state.step, **state.last_eval)
    if cfg.checkpoint.at_end:
        loop_state.save_full(job, state, async_save=False)
    job.saves.wait()
    return state


def _train_steps(
    job: Job, windows: StepWindows, state: LoopState, run_eval: Any, heartbeat: BackgroundHeartbeat, interval: LogWindow
) -> None:
    """Steps until max_steps. An async save may still be in flight at the end (job.saves). When the ranks act on
    their votes, at once or at a DiLoCo round's sync, is `rounds`'."""
    cfg, info = job.cfg, job.info
    last_full = time.monotonic()
    agreeing = rounds.for_job(job)
    step = state.step
    while step < cfg.train.max_steps:
        step += 1
        step_start = time.monotonic()
        position = job.sampler.state_dict()  # where this step's data starts: a preemption save resumes here
        window = next(windows)  # the step's micro-batches
        data_wait = time.monotonic() - step_start
        health.record_progress(info, step, health.CONTROL)
        own = agreement.own_votes(job, window, last_full)
        votes = own.summed(agreement.votes_device(info), agreement.step_group(job))
        action = agreeing.before_training(state, votes, position)
        if action is rounds.Action.STOP:
            return
        lr = job.scheduler.get_last_lr()[0]
        trains = action is rounds.Action.TRAIN
        step_loss, grad_norm = _train_window(job, window, votes, step) if trains else (None, torch.tensor(float("nan")))
        if step_loss is None:
            interval.skip()  # its loss, tokens, time and comm stay out of the next train event
            if not agreeing.goes_on_untrained():
                continue
        tokens = agreeing.tokens(votes, trained=step_loss is not None)
        state.tokens += tokens
        step, agreed = agreeing.close_step(step, state, votes)
        if agreeing.weights_agree(step):
            _check_replicas(job, step)
        step_time = time.monotonic() - step_start
        state.step = step
        if step_loss is not None:
            if step > 1:
                state.steady_tokens += tokens
                state.steady_time += step_time
            interval.add(step_loss, own.targets, own.real_tokens, own.flops, step_time, data_wait)
        heartbeat.step = step
        if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:  # before a stop: the step was trained
            events.log_interval(state, job, interval, lr, grad_norm, agreed is not None, windows.since_log())
        if agreeing.stops(state, agreed):
            return
        if run_eval and cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
            state.last_eval = run_eval(step)
            job.sink.emit("eval", step=step, **state.last_eval)
        timed_save = agreed is not None and agreed.timed_save > 0
        full_due = (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or timed_save
        if full_due and step < cfg.train.max_steps:
            loop_state.save_full(job, state, async_save=cfg.checkpoint.async_save)
            last_full = time.monotonic()
        elif cfg.checkpoint.lite_every_steps and step % cfg.checkpoint.lite_every_steps == 0:
            job.saves.save_lite(job.model, step)


def _train_window(
    job: Job, window: list[dict[str, torch.Tensor]], votes: agreement.StepVotes, step: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Forward, backward, clip and the optimizer step: this rank's loss sum and the gradient norm, or no loss where
    the norm was non-finite and the step skipped. The norm spans the step's group, so its ranks skip together."""
    try:
        step_loss = _forward_backward(job, window, votes.targets, step)
    except torch.OutOfMemoryError:
        raise oom.explain(job, window, step, job.strategy) from None
    health.record_progress(job.info, step, health.REPORT)  # clipping and logging gather next
    grad_norm = grad_norm_and_clip(job.model, job.cfg.train.max_grad_norm)
    if not torch.isfinite(grad_norm):
        job.optimizer.zero_grad(set_to_none=True)
        _report_nonfinite(job, step, step_loss, grad_norm)
        return None, grad_norm
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def _report_nonfinite(job: Job, step: int, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Name the ranks of the step's group whose loss went non-finite; raise under on_nonfinite: error."""
    culprits = health.flagged_ranks(not bool(torch.isfinite(step_loss)), job.info, agreement.step_group(job))
    if job.cfg.train.on_nonfinite == "error":
        raise NonFiniteError(
            f"non-finite loss or gradient at step {step}: "
            + (
                f"the loss was non-finite on rank(s) {culprits}"
                if culprits
                else f"gradient norm {grad_norm.item()}, losses finite"
            ),
            fix="lower train.lr, check that rank's data, or set train.on_nonfinite: skip",
        )
    job.sink.emit("system", step=step, event="skipped_nonfinite_step", ranks=culprits,
                  **events.site_field(job, whole_world=False))
    if job.outer is not None and not job.info.is_main:  # rank 0 sees its own site's only: the site's logs say it
        logging.getLogger("trainyard").warning("skipped non-finite step %d (site %d, ranks %s)", step,
                                               job.outer.site, culprits)


def _forward_backward(job: Job, window: list[dict[str, torch.Tensor]], targets: float, step: int) -> torch.Tensor:
    """Forward and backward over the window; gradients reduced as `parallel.gradient_sync` says.
    Returns the summed (unscaled) loss of this rank's window."""
    info, model = job.info, job.model
    # DDP/FSDP average gradients over ranks; multiplying back by the ranks that counted `targets` (the world, or a
    # DiLoCo site) makes the gradient that of the summed loss over every target token (or pair) they hold.
    scale = len(dist.group_ranks(agreement.step_group(job))) / max(targets, 1.0)
    step_loss = torch.zeros((), dtype=torch.float64, device=info.device)
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        with parallel.gradient_sync(model, last=last, defer=job.cfg.dist.defer_grad_sync):
            with job.autocast():
                loss_sum = job.objective.loss_sum(model, batch, info.device)
            if health.injected("nan", info, step):
                loss_sum = loss_sum * float("nan")
            if health.injected("oom", info, step):
                raise torch.OutOfMemoryError("injected by TRAINYARD_FAULT")
            if last:
                health.record_progress(info, step, health.GRAD_SYNC)
            (loss_sum * scale).backward()
        step_loss += loss_sum.detach().double()
    return step_loss


def _check_replicas(job: Job, step: int) -> None:
    """Every desync_check_steps, DDP replicas compare their weights (FSDP shards differ by design)."""
    cfg, info = job.cfg, job.info
    every = cfg.dist.desync_check_steps
    if not (every and step % every == 0 and info.distributed and not dist.is_fsdp(job.model)):
        return
    if health.injected("desync", info, step):
        health.corrupt_one_parameter(job.model)
    health.check_replicas_agree(job.model, info, step, cfg.dist.desync_tolerance)


def _worst_batch(cfg: JobConfig, rows: Any, data_world: int) -> list[int]:
    """The rows of the first optimizer step under train.worst_batch_first: the epoch's largest, so the first step
    holds every rank's largest micro-batch."""
    if not cfg.train.worst_batch_first:
        return []
    return largest_rows(rows, cfg.train.micro_batch_size * accumulation_steps(cfg, data_world) * data_world)


def _size_by_epochs(job: Job, state: LoopState) -> None:
    """train.epochs becomes max_steps here, once: the rows are known (bad rows dropped) and the global batch settled
    (a resume keeps the checkpoint's, so the steps). The schedule and the ETA read max_steps as they go; status
    reads it from config.yaml, written next."""
    train, rows = job.cfg.train, len(job.data.train)
    samples = job.facts["global_batch_samples"]
    steps = steps_for_epochs(job.cfg, rows, diloco_ft.data_slice(job.cfg, job.info)[1], saved_samples=samples)
    train.epoch_rows = rows  # first: max_steps next to epochs needs it (TrainConfig._one_length)
    train.max_steps = steps
    job.sink.emit("system", step=state.step, event="steps_from_epochs", epochs=train.epochs, rows=rows,
                  global_batch_samples=samples, max_steps=steps)


def _windows(job: Job) -> Any:
    """Each step's micro-batches: `job.accum` of micro_batch_size rows, or under train.micro_batch_tokens the same
    rows in as few token-bounded micro-batches as hold them."""
    cfg, pad_id = job.cfg, job.tokenizer.pad_token_id
    record = sample_record_path(cfg.run_dir, job.info.rank)
    one_row = collation.model_one_row(parallel.unwrap(job.model), cfg.data)
    context = context_parallel.slice_of(job.model)  # this rank's slice of each row: (0, 1) without context parallelism
    micro = cfg.train.micro_batch_size
    if isinstance(job.sampler, MixtureStream):
        return accumulation_windows(stream_batches(job.sampler, micro, pad_id, record, one_row, context), job.accum)
    if cfg.train.micro_batch_tokens is not None:  # run() logged how many a step takes
        return token_windows(job.data.train, job.sampler, micro * job.accum, cfg.train.micro_batch_tokens, pad_id,
                             record, context, cfg.data.balance_ranks)
    batches = micro_batches(job.data.train, job.sampler, micro, pad_id, record, one_row, context,
                            cfg.data.balance_ranks)
    return accumulation_windows(batches, job.accum)


def _loop_facts(job: Job) -> dict[str, object]:
    """Fault-tolerant DiLoCo: what a site that heals from this one takes besides the outer and inner optimizer
    state: the data position, the schedule and this rank's random streams."""
    return {"sampler": job.sampler.state_dict(), "scheduler": job.scheduler.state_dict(),
            "rng": loop_state.rng_state()}


def _evaluator(job: Job):
    cfg = job.cfg
    if job.data.eval is None or len(job.data.eval) == 0:
        return None

    def run_eval(step: int) -> dict[str, float]:
        """One evaluation; with eval.generate its generations are kept in samples/ under its step."""
        started = time.monotonic()
        figures = evaluate(
            job.model,
            job.data.eval,
            subset_size=cfg.eval.subset_size,
            seed=cfg.eval.seed,
            batch_size=cfg.eval.batch_size,
            info=job.info,
            tokenizer=job.tokenizer,
            generate=cfg.eval.generate,
            max_new_tokens=cfg.eval.max_new_tokens,
            autocast=job.autocast,
            padding_free=collation.model_one_row(parallel.unwrap(job.model), cfg.data),
            samples_path=samples_file(cfg.run_dir, step) if cfg.eval.generate else None,
            dpo=cfg.dpo if cfg.train.objective == "dpo" else None,
        )
        return {**figures, "eval_s": round(time.monotonic() - started, 3)}

    return run_eval


def run(cfg: JobConfig) -> dict[str, Any]:
    """The whole job: init, data, model, wrap, fit, summary. Every rank runs it."""
    wall_start = time.monotonic()
    title.name_worker(cfg.run_name)  # `ps` and py-spy tell the ranks apart, forked ones included
    transformers.utils.logging.disable_progress_bar()  # our own progress line is the only one
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    info = dist.init(cfg.dist, run_dir=cfg.run_dir, nic_where=cfg.where("dist.nic"))
    across = diloco_ft.FaultTolerantSync(cfg, info) if cfg.diloco.fault_tolerant else None  # heartbeats from here
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(run_dir, info)
    precision = precision_room.resolve(cfg, info.device)
    if info.is_main:
        logger.info(
            "run dir %s  world %d  device %s  network %s  precision %s  malloc %s",
            run_dir, info.world_size, info.device, info.network or "default",
            precision_room.describe(precision, cfg.lora.enabled), allocator.describe(),
        )
    for note in cfg._notes if info.is_main else ():
        logger.info("%s", note)
    # the frozen base's dtype: an export quantizes an NF4 base in it again, as the load did
    environment = {**environment_record(info), "frozen_dtype": str(precision.frozen_dtype).removeprefix("torch.")}
    if info.is_main:
        write_json(run_dir / run_layout.ENV, environment)

    model_source = source_room.fetch_hub_model(cfg.model)  # before any collective: a download outlasts its timeout
    model_path = None
    with dist.first_on_node(info):  # one process per node converts/loads caches first
        if model_source.path is not None:
            model_path = source_room.resolve_model_path(model_source)
        tokenizer = source_room.load_tokenizer(model_source, model_path)
    cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / ".cache" / "data"
    if cfg.data.mixture:
        data, shards = prepare_pretraining(cfg, tokenizer, cache_root, logger.info, show_progress=info.is_main)
    else:
        data = prepare_datasets(cfg.data, tokenizer, cache_root, log=logger.info, objective=cfg.train.objective)
    cfg = build.planned_context(cfg, info, None if cfg.data.mixture else data.train)  # auto: planned from the rows
    data_rank, data_world = diloco_ft.data_slice(cfg, info)  # a fault-tolerant site reads its own slice
    if cfg.data.mixture:
        sampler: ResumableSampler | MixtureStream = mixture_stream(cfg, shards, data_rank, data_world)
    else:
        sampler = ResumableSampler(len(data.train), seed=cfg.train.seed, rank=data_rank, world_size=data_world,
                                   first=_worst_batch(cfg, data.train, data_world))

    model, strategy, mesh = build.build_and_wrap(cfg, info, precision, model_path, tokenizer,
                                                 train_rows=None if cfg.data.mixture else data.train)
    total_params, trainable_params = model_room.parameter_counts(model)
    accum = accumulation_steps(cfg, data_world)
    logger.info(
        "strategy %s  mesh %s  %s  params %s (trainable %s)", strategy, dist.describe_mesh(mesh),
        plan_batching.accumulation_words(cfg, accum, None if cfg.data.mixture else data.train),
        f"{total_params:,}",
        f"{trainable_params:,}",
    )

    torch.manual_seed(cfg.train.seed + info.rank)  # dropout differs per rank, data order does not
    optimizer, scheduler = build_optimizer(model, cfg)
    sink = MetricsSink(cfg, info, logger)
    job = Job(
        cfg=cfg,
        info=info,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        data=data,
        tokenizer=tokenizer,
        sink=sink,
        accum=accum,
        flops=flop_shape(parallel.unwrap(model)),
        facts={
            "model_signature": checkpoint.model_signature(model),
            "lora": cfg.lora.model_dump(mode="json") if cfg.lora.enabled else None,
            "data_fingerprint": data.fingerprint,
            "global_batch_samples": cfg.train.micro_batch_size * accum * data_world,
            "expert_parallel": expert_parallel.size_of(parallel.unwrap(model)),
        },
        saves=checkpoint.Checkpointer(
            cfg.checkpoint, cfg.run_dir / run_layout.CHECKPOINTS, info, sink.emit,
            tokenizer_as_trained(tokenizer, cfg.data) if cfg.lora.enabled else None,
        ),
        precision=precision,
        strategy=strategy,
    )
    job.objective = build_objective(job, logger.info)  # before resume: full fine-tuning's reference reads the start
    job.comm_timer = comm.attach_comm_timer(model)
    if strategy == "diloco":
        assert mesh is not None
        job.outer = diloco.OuterSync(model, cfg.diloco, mesh, info)
        job.saves.arrange = job.outer.arrangement()
        job.facts["diloco_sites"] = job.outer.sites
        if across is not None:
            job.across = across
            across.attach(job.outer, lambda: _loop_facts(job), job.optimizer)
    state = loop_state.resume(job)
    if cfg.train.epochs is not None:
        _size_by_epochs(job, state)
    if info.is_main:  # after resume's checks: a rejected job never replaces the run's config
        write_atomically(run_dir / run_layout.CONFIG, dump_config(cfg))
    loop_state.install_preemption_handlers(cfg.checkpoint.preemption_signals)
    windows = StepWindows(_windows(job), cfg.train.micro_batch_tokens, job.accum)
    try:
        state = fit(job, windows, state)
    finally:
        job.sink.close()
        if job.across is not None:
            job.across.shutdown()
    ran = windows.summary()
    if words := plan_batching.ran_words(cfg, job.accum, ran["micro_batches_per_step"]):  # beside the start's plan
        logger.info("%s", words)
    summary = {
        "wall_time_s": time.monotonic() - wall_start,
        "steps": state.step,
        "tokens": state.tokens,
        "tokens_per_s": state.steady_tokens / state.steady_time if state.steady_time else None,
        "tokens_per_s_per_rank": state.steady_tokens / state.steady_time / info.world_size
        if state.steady_time
        else None,
        "world_size": info.world_size,
        "strategy": strategy,
        **ran,  # the accumulation, or a token budget's micro-batches per step
        "device": environment["cuda_devices"][0] if environment["cuda_devices"] else "cpu",
        "torch": torch.__version__,
        "model": cfg.model.path or f"config:{cfg.model.config.get('model_type') if cfg.model.config else None}",
        "dataset": [source.path for source in cfg.data.mixture] if cfg.data.mixture else cfg.data.path,
        "data_fingerprint": data.fingerprint,
        "data_stats": data.stats,
        **({"tokens_per_source": events.per_source(job)} if isinstance(sampler, MixtureStream) else {}),
        **({"epoch": events.epoch(sampler)} if isinstance(sampler, ResumableSampler) else {}),
        "params": total_params,
        "trainable_params": trainable_params,
        "first_train_loss": state.first_loss,
        "final_train_loss": state.last_loss,
        # the train events' (every rank's), and rank 0's to the end (its evaluation and save)
        "peak_memory_bytes": max(job.sink.peak_memory_bytes, int(memory_reading(info.device).peak)),
        "final_eval_loss": state.last_eval.get("eval_loss"),
        "final_eval_accuracy": state.last_eval.get("eval_accuracy"),
        "baseline_eval_loss": state.baseline_eval.get("eval_loss"),
        "baseline_eval_accuracy": state.baseline_eval.get("eval_accuracy"),
    }
    if info.is_main:
        write_json(run_dir / run_layout.SUMMARY, summary)
    dist.teardown()
    return summary

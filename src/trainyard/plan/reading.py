"""What a plan reads before it decides: the data's lengths (surveyed by the dry run, prepared by `train`, or not
read), and the checkpoint a resume would start from. Read here, so the dry run and `train` plan from the same
figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainyard.batch import accumulation_steps, data_ranks, steps_for_epochs
from trainyard.checkpoint.layout import committed, latest_full, newest_intact
from trainyard.config import JobConfig
from trainyard.data import survey as data_survey
from trainyard.doctor.preflight import check_source
from trainyard.errors import TrainyardError
from trainyard.estimate.timing import Lengths
from trainyard.model import source as source_room
from trainyard.runs import layout as run_layout

MIXTURE_ROWS = "a mixture's rows are packed to data.max_length"


def survey_data(cfg: JobConfig, problems: list[str]) -> tuple[data_survey.Survey | None, list[str], Lengths]:
    """The data's survey (None where the rows were not encoded: the lines say why) and the documents' lengths for
    the estimate; a problem when the data is unusable. The survey's own lines (`data_lines`) count the data ranks,
    which dist.context_parallel auto decides from these lengths."""
    if cfg.data.mixture:
        return None, [], Lengths(batch_why=MIXTURE_ROWS)
    tokenizer, why = source_room.offline_tokenizer(cfg.model)
    try:
        if tokenizer is None:
            _check_files(cfg)
            lengths = Lengths(batch_why=f"the rows were not encoded: {why}")
            return None, [f"data             {cfg.data.path}: readable; rows not encoded: {why}"], lengths
        found = data_survey.survey(cfg, tokenizer)
    except TrainyardError as err:
        problems.append(f"the data is unusable: {problem_words(err)}")
        return None, [f"data             unusable: {err.what}"], Lengths()
    return found, [], _lengths_found(cfg, found)


def data_lines(cfg: JobConfig, found: data_survey.Survey, ranks: int) -> list[str]:
    """The survey's lines for a job whose rows `ranks` data ranks read; with train.epochs, `cfg`'s max_steps from
    the rows counted."""
    accum = accumulation_steps(cfg, ranks)
    samples = cfg.train.micro_batch_size * accum * ranks
    if cfg.train.epochs is not None:
        rows = max(round(found.usable_rows_estimate()), 1)
        cfg.train.epoch_rows, cfg.train.max_steps = rows, steps_for_epochs(cfg, rows, ranks)
    return data_survey.describe(found, cfg, samples)


def _lengths_found(cfg: JobConfig, found: data_survey.Survey) -> Lengths:
    """The estimate's token lengths from a survey: every document, and the rows (DPO: pairs) they make."""
    cuts = data_survey.percentiles(found.lengths)
    unit = "pairs" if cfg.train.objective == "dpo" else "documents"
    source = f"the data's {found.usable:,} {unit}, p50 {cuts['p50']:,} tokens"
    read = "the data's largest" if found.encoded >= found.rows else f"the largest of the {found.encoded:,} rows read"
    return Lengths(tuple(found.documents), source, found.usable_rows_estimate(), read)


def problem_words(err: TrainyardError) -> str:
    where = f"{err.where}: " if err.where else ""
    return f"{where}{err.what}" + (f" (fix: {err.fix})" if err.fix else "")


def _check_files(cfg: JobConfig) -> None:
    """Without the tokenizer, at least every data file exists and parses (preflight's checks)."""
    for field, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if value and not value.startswith("builtin:"):
            check_source(Path(value), field, cfg.data.on_bad_row == "skip", cfg.train.objective)


def data_lengths(cfg: JobConfig, world_size: int) -> Lengths:
    """The documents' token lengths for `trainyard estimate`, when the data and tokenizer can be read here; with
    train.epochs, `cfg`'s max_steps from the rows counted."""
    if cfg.data.mixture:
        return Lengths(batch_why=MIXTURE_ROWS)
    tokenizer, why = source_room.offline_tokenizer(cfg.model)
    if tokenizer is None:
        return Lengths(source=f"data.max_length: {why}", batch_why=f"the rows were not encoded: {why}")
    try:
        found = data_survey.survey(cfg, tokenizer)
    except TrainyardError as err:
        unusable = f"the data is unusable ({err.what})"
        return Lengths(source=f"data.max_length: {unusable}", batch_why=unusable)
    if cfg.train.epochs is not None:
        rows = max(round(found.usable_rows_estimate()), 1)
        cfg.train.epoch_rows, cfg.train.max_steps = rows, steps_for_epochs(cfg, rows, data_ranks(cfg, world_size))
    return _lengths_found(cfg, found)


def prepared_lengths(cfg: JobConfig, train_rows: Any) -> Lengths:
    """The trainer's lengths, to choose and check its plan by as the dry run does: its prepared rows' documents."""
    if cfg.data.mixture:
        return Lengths(batch_why=MIXTURE_ROWS)
    if train_rows is None:
        return Lengths(batch_why="the rows were not given")
    return Lengths(data_survey.prepared_documents(train_rows), batch_why="the data's largest")


def resume_words(cfg: JobConfig, problems: list[str]) -> str:
    """What checkpoint.resume will start from, checked now rather than on the nodes."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return "never: a fresh start"
    if resume == "auto":
        return auto_resume_words(cfg.run_dir)
    from trainyard.checkpoint.export import find_checkpoint  # PEFT and the export: only to resume from a path

    try:
        step = find_checkpoint(Path(resume))
    except TrainyardError as err:
        problems.append(f"checkpoint.resume ({cfg.where('checkpoint.resume') or 'override'}): {problem_words(err)}, "
                        "or use auto or never")
        return f"{resume}: unusable"
    return f"from {step}"


def auto_resume_words(run_dir: Path) -> str:
    """auto resumes from the newest intact checkpoint: the dry run names it and every damaged one it passes over."""
    checkpoints = run_dir / run_layout.CHECKPOINTS
    newest = newest_intact(checkpoints) if checkpoints.is_dir() else None
    latest = latest_full(checkpoints) if checkpoints.is_dir() else None
    damaged = [p.name for p in committed(checkpoints) if latest and newest != p and p.name <= latest.name
               and (newest is None or p.name > newest.name)]
    passed = f" (passing over damaged {', '.join(damaged)})" if damaged else ""
    if newest:
        return f"auto: from {newest}{passed}"
    if damaged:
        return f"auto: every committed checkpoint in {run_dir} is damaged{passed}, a fresh start"
    return f"auto: nothing committed in {run_dir} yet, a fresh start"

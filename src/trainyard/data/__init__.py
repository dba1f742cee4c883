"""Data: rows -> masked token ids (formats, chat templates), a rank-safe tokenized cache, a resumable sampler,
batches, pretraining shards and mixtures, the dry run's survey. Never imports the model, parallelism, the plan, the
estimate, training, checkpoints or metrics: a tokenizer is all it knows of the model."""

from trainyard.data.collate import collate
from trainyard.data.formats import IGNORE_INDEX, alpaca_prompt, detect_format, encode_row, read_rows
from trainyard.data.loader import micro_batches, sample_record_path
from trainyard.data.prepare import PreparedData, data_fingerprint, prepare_datasets
from trainyard.data.sampler import ResumableSampler
from trainyard.data.synthetic import builtin_rows, spoken_date
from trainyard.data.tokenizer import build_byte_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "PreparedData",
    "ResumableSampler",
    "alpaca_prompt",
    "build_byte_tokenizer",
    "builtin_rows",
    "collate",
    "data_fingerprint",
    "detect_format",
    "encode_row",
    "micro_batches",
    "prepare_datasets",
    "read_rows",
    "sample_record_path",
    "spoken_date",
]

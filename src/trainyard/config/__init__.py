"""The job schema: every section and field, its defaults and checks, and the batch rule.

One YAML file describes a job; every field has a default so a file only says what differs. Each concern's sections
live in a module of their own (`model`, `data`, `loop`, `dist`, `job`, on the `section` base); everyone imports
them from here. config_file.py reads a YAML file and overrides into it.
"""

from trainyard.config.data import DataConfig, MixtureSource
from trainyard.config.dist import DilocoConfig, DistConfig
from trainyard.config.job import JobConfig
from trainyard.config.loop import CheckpointConfig, EvalConfig, LogConfig, TrainConfig
from trainyard.config.model import LoraConfig, ModelConfig
from trainyard.config.preference import DpoConfig

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DilocoConfig",
    "DistConfig",
    "DpoConfig",
    "EvalConfig",
    "JobConfig",
    "LogConfig",
    "LoraConfig",
    "MixtureSource",
    "ModelConfig",
    "TrainConfig",
]

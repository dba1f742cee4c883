"""The random init of a model.config job: drawn once per node into a file every rank reads its rows from, with
the numbers a single process draws."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from trainyard.config import ModelConfig
from trainyard.data import build_byte_tokenizer
from trainyard.model.build import random_init, random_init_file
from trainyard.model.source import architecture

TIED = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}


def job_model() -> tuple[ModelConfig, object]:
    cfg = ModelConfig(config=TIED, tokenizer="builtin:bytes")
    return cfg, architecture(cfg, build_byte_tokenizer(), None)


def test_the_file_holds_what_one_process_draws_tied_weights_included(tmp_path: Path) -> None:
    cfg, config = job_model()
    drawn = random_init(cfg, config, seed=7)
    written = load_file(random_init_file(cfg, config, 7, tmp_path))
    assert sorted(written) == sorted(drawn)
    for name, tensor in drawn.items():
        assert torch.equal(written[name], tensor), name
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])


def test_a_second_call_reads_the_file_and_another_seed_draws_another(tmp_path: Path) -> None:
    cfg, config = job_model()
    first = random_init_file(cfg, config, 7, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert random_init_file(cfg, config, 7, tmp_path) == first and first.stat().st_mtime_ns == stamp
    other = random_init_file(cfg, config, 8, tmp_path)
    assert other != first
    assert not torch.equal(load_file(other)["lm_head.weight"], load_file(first)["lm_head.weight"])


DRAW = """
import sys, time
from pathlib import Path
import trainyard.model.build as build
from tests.unit.model.test_build import job_model
drawn = build.random_init
def counted(*args, **kwargs):
    Path(sys.argv[2], str(time.monotonic_ns())).write_text("drew")
    time.sleep(1)
    return drawn(*args, **kwargs)
build.random_init = counted
cfg, config = job_model()
print(build.random_init_file(cfg, config, 7, Path(sys.argv[1])))
"""


def test_processes_of_a_node_draw_once_and_read_one_file(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    children = [subprocess.Popen([sys.executable, "-c", DRAW, str(tmp_path / "cache"), str(marks)], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {child.communicate(timeout=120)[0].strip() for child in children}
    assert all(child.returncode == 0 for child in children)
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    assert len(list(marks.iterdir())) == 1, "more than one process drew the whole model"

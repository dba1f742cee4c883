"""The random init of a model.config job: drawn once per node into a file every rank reads its rows from, with
the numbers a single process draws."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests import warm
from tests.conftest import REPO
from trainyard.config import ModelConfig
from trainyard.data import build_byte_tokenizer
from trainyard.model import build as model_build
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


def draw(cache: Path, marks: Path) -> None:
    """One process of a node: its whole-model draw marked in `marks` and held a second, so the others find it
    drawing; prints the file it was given."""
    drawn = model_build.random_init

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        (marks / str(time.monotonic_ns())).write_text("drew")
        time.sleep(1)
        return drawn(*args, **kwargs)

    model_build.random_init = counted
    cfg, config = job_model()
    print(model_build.random_init_file(cfg, config, 7, cache))


def node_process(cache: Path, marks: Path) -> warm.Command | subprocess.Popen[str]:
    """`python -m` this module (`draw`) in a process of its own: forked from the warm server (tests/warm.py), as
    trainyard's fork server starts a node's ranks, so no interpreter imports torch again (~7 s of CPU each); a
    fresh interpreter where the server does not serve."""
    argv, env = [str(cache), str(marks)], dict(os.environ)
    if os.environ.get(warm.FRESH_SWITCH) != "1" and warm.server().serves(env):
        return warm.Command(argv, REPO, env, new_session=False, module=__name__)
    return subprocess.Popen([sys.executable, "-m", __name__, *argv], cwd=REPO, stdout=subprocess.PIPE, text=True)


def test_processes_of_a_node_draw_once_and_read_one_file(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    children = [node_process(tmp_path / "cache", marks) for _ in range(3)]
    paths = {child.communicate(timeout=120)[0].strip() for child in children}
    assert all(child.returncode == 0 for child in children)
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    assert len(list(marks.iterdir())) == 1, "more than one process drew the whole model"


if __name__ == "__main__":
    draw(Path(sys.argv[1]), Path(sys.argv[2]))
    gc.freeze()  # leave as trainyard's commands do (cli.exit_process): no collection over the fork's whole stack

"""One HF-config resolver: the estimate counts the parameters of exactly the model the build makes, for every
shipped config whose architecture this machine has (the hub ones come from the estimator's table). A hub id is
downloaded by one process at a time, under a lock the others wait on for at most model.download_timeout_s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from tests.conftest import REPO
from trainyard.atomic import process_identity
from trainyard.config import ModelConfig
from trainyard.config_file import load_config
from trainyard.errors import ModelError
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import memory as estimate_memory
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def built_counts(config_path: Path) -> tuple[int, int]:
    """The build's way: the tokenizer, the one resolver, the meta model with LoRA."""
    cfg = load_config(str(config_path))
    if cfg.model.config is None and cfg.model.path in estimate_arch.KNOWN_ARCHITECTURES:
        pytest.skip(f"{cfg.model.path} is not on this machine: the build would download it")
    model_path = source_room.resolve_model_path(cfg.model) if cfg.model.path else None
    tokenizer, why = source_room.offline_tokenizer(cfg.model)
    if tokenizer is None and "vocab_size" not in (cfg.model.config or {}):
        pytest.skip(why)
    config = source_room.architecture(cfg.model, tokenizer, model_path)
    model = model_room.build_meta_model(cfg.model, config, torch.float32, torch.device("cpu"))
    if cfg.lora.enabled:
        with lora_room.real_stand_ins(model, torch.float32):
            model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    return model_room.parameter_counts(model)


@pytest.mark.parametrize("config_path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_the_estimate_counts_the_parameters_of_the_model_the_build_makes(config_path: Path) -> None:
    counts = estimate_memory.model_of(load_config(str(config_path))).counts
    assert (counts.total, counts.trainable) == built_counts(config_path)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own, empty HF cache."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_id_is_downloaded_holding_the_lock_then_read_as_a_folder(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = source_room.download_lock("org/model")
    held_while_downloading = []

    def snapshot_download(repo_id: str, **_: object) -> str:
        held_while_downloading.append(lock.exists())
        return str(tmp_path)

    monkeypatch.setattr(source_room, "snapshot_download", snapshot_download)
    fetched = source_room.fetch_hub_model(ModelConfig(path="org/model"))
    assert fetched.path == str(tmp_path) and held_while_downloading == [True]
    assert lock.is_relative_to(hub_cache) and not lock.exists()
    assert source_room.resolve_model_path(fetched) == str(tmp_path)


def test_waiting_longer_than_model_download_timeout_s_for_another_download_names_the_setting(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source_room, "snapshot_download", lambda *_, **__: pytest.fail("downloaded past the lock"))
    lock = source_room.download_lock("org/model")
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps(dict(process_identity(), pid=1)))  # a live process on this host: still downloading
    with pytest.raises(ModelError) as err:
        source_room.fetch_hub_model(ModelConfig(path="org/model", download_timeout_s=0.3))
    assert "model.download_timeout_s" in err.value.what and str(lock) in err.value.what
    assert "raise model.download_timeout_s" in err.value.fix
    assert err.value.exit_code == 2
    assert lock.exists()


def test_offline_a_hub_id_is_read_from_the_cache_without_a_lock(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(source_room, "snapshot_download", lambda *_, **__: str(tmp_path))
    assert source_room.fetch_hub_model(ModelConfig(path="org/model")).path == str(tmp_path)
    assert not hub_cache.exists()  # a read-only cache works as before


def test_a_gguf_file_s_cache_key_is_its_content_wherever_it_is_installed(tmp_path: Path) -> None:
    """The quickstart's model in another environment (a fresh clone's .venv) reuses the folder converted before;
    other content gets another folder."""
    shipped = source_room.builtin_gguf_file("builtin:smollm2-135m-instruct")
    here, there = tmp_path / "a" / shipped.name, tmp_path / "b" / shipped.name
    for copy in (here, there):
        copy.parent.mkdir()
        shutil.copyfile(shipped, copy)
    assert source_room._gguf_cache_key(here) == source_room._gguf_cache_key(there)
    with open(there, "r+b") as handle:  # one byte of the tensor data, halfway in
        handle.seek(there.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert source_room._gguf_cache_key(here) != source_room._gguf_cache_key(there)


def test_processes_converting_one_gguf_at_once_convert_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second waits on the first's lock, then reads its folder (the conversion itself stood in for: a real one
    takes a minute, and the suite makes one)."""
    import threading
    import time

    converted = []

    def convert_into(gguf: Path, target: Path) -> None:
        converted.append(target)
        time.sleep(1.0)
        target.mkdir()
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(source_room, "_convert_apart", convert_into)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(4096))
    (tmp_path / "cache").mkdir()
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(source_room.convert_gguf(gguf, tmp_path / "cache")))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(converted) == 1 and found == [converted[0], converted[0]]
    assert not list((tmp_path / "cache").glob("*.lock"))


def test_a_gguf_file_transformers_cannot_read_is_refused_naming_it_and_leaves_nothing(tmp_path: Path) -> None:
    """The conversion runs in a process of its own (its two fp32 copies of the model never count in a rank's peak):
    its failure comes back to the rank as a ModelError with the reader's one line."""
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ModelError) as raised:
        source_room.convert_gguf(gguf, cache)
    assert f"GGUF file {gguf} could not be converted" in str(raised.value)
    assert "the converting process ended" not in str(raised.value), "the reader's own error comes back"
    assert gguf.read_bytes().startswith(b"GGUF") and not list(cache.iterdir())


def test_a_converted_gguf_s_config_comes_from_its_folder_not_its_header(tmp_path: Path) -> None:
    """The plan reads the built-in model's config from the converted folder where one exists (the header's reader
    parses the whole tokenizer: seconds); the folder here says 3 layers, the header 30, so the answer tells which."""
    cfg = ModelConfig(path="builtin:smollm2-135m-instruct", cache_dir=str(tmp_path))
    folder = source_room.converted_folder(source_room.builtin_gguf_file(cfg.path), tmp_path)
    folder.mkdir()
    small = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}
    (folder / "config.json").write_text(json.dumps(small))
    assert source_room.architecture(cfg, None).num_hidden_layers == 3


def test_the_estimate_builds_a_job_s_model_once_and_again_when_its_config_json_changes(tmp_path: Path) -> None:
    """model_of keeps what it built per job; a folder whose config.json is rewritten is read and built again."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"))
    cfg.model = cfg.model.model_copy(update={"config": None, "path": str(tmp_path), "tokenizer": None})
    first = estimate_memory.model_of(cfg)
    assert estimate_memory.model_of(cfg) is first
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    again = estimate_memory.model_of(cfg)
    assert again.shape.layers == 3 and again.counts.total > first.counts.total

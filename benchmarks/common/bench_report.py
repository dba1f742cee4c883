"""bench.py's table: medians over rounds, MFU against the measured roofline, ratios, misses, RESULTS.md.

MFU counts model FLOPs only on real tokens: trainyard.hardware.flops_per_token (forward 2N, backward
2N + 2N_trainable over the matmul weights a token passes, causal attention of a document of the data's mean
length) x real tokens/s / the measured matmul peak of the dtype the row computes in (bf16 for trainyard at its
defaults on a CPU with avx512_bf16/AMX).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench_env
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainyard.hardware import FlopShape, flop_shape, flops_per_token

FIGURES = ("tokens_per_s", "s_per_step", "peak_bytes", "launch_s", "eval_s", "lite_s", "full_s", "mfu")
HF_ROWS = ("hf-seeds", "hf-best", "trl")
TARGETS = [  # (what, figure, against, limit, higher is better)
    ("real tokens/s >= 3x the best HF/TRL row", "tokens_per_s", "best", 3.0, True),
    ("real tokens/s >= 6x hf-seeds", "tokens_per_s", "hf-seeds", 6.0, True),
    ("evaluation time <= 0.5x HF's (hf-best)", "eval_s", "hf", 0.5, False),
    ("launch to first step <= 0.7x HF's (hf-best)", "launch_s", "hf", 0.7, False),
]
MFU_TARGET = 0.25
WHAT = {
    "trainyard": "trainyard train, its defaults (precision, attention, no packing), micro 4 x 2 ranks",
    "hf-seeds": "HF Trainer as seed 002: pad to 512, batch 1 x 2 ranks x accumulation 4, labels = input_ids",
    "hf-best": "HF Trainer: dynamic padding, response-only labels, batch 4 x 2 ranks",
    "trl": "TRL SFTTrainer: prompt/completion, completion-only loss, batch 4 x 2 ranks",
}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def variant_label(row: str, variant: dict[str, Any]) -> str:
    parts = []
    if "bf16" in variant:
        parts.append("bf16" if variant["bf16"] else "fp32")
    if variant.get("sampling"):
        parts.append(variant["sampling"])
    if variant.get("padding_free"):
        parts.append({"check": "padding-free?", "on": "padding-free", "off": "padded"}[variant["padding_free"]])
    return f"{row}[{','.join(parts)}]" if parts else row


def lora_flop_shape(model_path: str, params: int, trainable: int) -> FlopShape:
    """Every row trains LoRA: the base model's shape (meta-built) plus its adapters, all of them trainable matmul
    weights a token passes through."""
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    shape = flop_shape(base)
    adapters = params - sum(p.numel() for p in base.parameters())
    return replace(shape, active=shape.active + adapters, trainable=trainable)


def add_mfu(runs: list[Any], roofline: dict[str, Any], model_path: str, mean_len: float) -> None:
    for run in runs:
        f = run.figures
        if run.error or not f:
            continue
        shape = lora_flop_shape(model_path, f["params"], f["trainable_params"])
        per_token = flops_per_token(shape, [mean_len])
        peak = roofline["peak_gflops"].get(f["dtype"])
        f["mfu"] = f["tokens_per_s"] * per_token / (peak * 1e9) if peak else None


def combine(executed: list[Any]) -> dict[str, dict[str, Any]]:
    """Per row: medians of the kept variant's runs (round 1's winner and later rounds)."""
    rows: dict[str, dict[str, Any]] = {}
    for row in dict.fromkeys(run.row for run in executed):
        mine = [r for r in executed if r.row == row]
        kept = [r for r in mine if not r.error and (r.round > 0 or r.figures.get("kept", True))]
        if not kept:
            rows[row] = {"error": mine[0].error, "label": mine[0].label}
            continue
        merged: dict[str, Any] = {"label": kept[0].label, "dtype": kept[0].figures["dtype"], "rounds": len(kept)}
        for key in FIGURES:
            values = [r.figures[key] for r in kept if isinstance(r.figures.get(key), int | float)]
            merged[key] = median(values) if values else None
        merged["tokens_per_s_rounds"] = [round(r.figures["tokens_per_s"], 1) for r in kept]
        rows[row] = merged
    return rows


def references(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    good = {name: row for name, row in rows.items() if not row.get("error")}
    others = [good[name] for name in HF_ROWS if name in good]
    best = max(others, key=lambda row: row["tokens_per_s"], default=None)
    return {"hf-seeds": good.get("hf-seeds"), "best": best, "hf": good.get("hf-best") or good.get("hf-seeds")}


def ratio(value: float | None, base: dict[str, Any] | None, key: str) -> str:
    if value is None or not base or not base.get(key):
        return "-"
    return f"{value / base[key]:.2f}x"


def number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    ref = references(rows)
    best_name = ref["best"]["label"] if ref["best"] else "-"
    lines = [
        f"| row | real tokens/s | s/step | vs hf-seeds | vs best HF/TRL ({best_name}) | MFU (measured peak) "
        "| peak RSS/rank GB | launch -> step 1 s (vs hf-best) | eval s (vs hf-best) | lite save s | full save s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        if row.get("error"):
            lines.append(f"| {row['label']} | failed | | | | | | | | | |")
            continue
        mfu = f"{row['mfu']:.1%} ({row['dtype']})" if row.get("mfu") is not None else "-"
        lines.append(
            f"| {row['label']} | {row['tokens_per_s']:.1f} | {number(row['s_per_step'], '.2f')} | "
            f"{ratio(row['tokens_per_s'], ref['hf-seeds'], 'tokens_per_s')} | "
            f"{ratio(row['tokens_per_s'], ref['best'], 'tokens_per_s')} | {mfu} | "
            f"{number(row['peak_bytes'] and row['peak_bytes'] / 1e9, '.2f')} | "
            f"{number(row['launch_s'], '.1f')} ({ratio(row['launch_s'], ref['hf'], 'launch_s')}) | "
            f"{number(row['eval_s'], '.2f')} ({ratio(row['eval_s'], ref['hf'], 'eval_s')}) | "
            f"{number(row['lite_s'], '.3f')} | {number(row['full_s'], '.3f')} |"
        )
    return lines


def misses(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Every target trainyard misses (and the ones it meets), in plain sentences."""
    ty = rows.get("trainyard")
    if not ty or ty.get("error"):
        return ["- trainyard did not run or failed: no target checked"]
    ref, lines = references(rows), []
    for what, key, against, limit, higher in TARGETS:
        base = ref[against]
        if not base or ty.get(key) is None or not base.get(key):
            lines.append(f"- not checked: {what} (no {against} figure)")
            continue
        r = ty[key] / base[key]
        met = r >= limit if higher else r <= limit
        lines.append(f"- {'met' if met else 'MISS'}: {what}: {r:.2f}x ({ty[key]:.2f} vs {base[key]:.2f} "
                     f"for {base['label']})")
    if ty.get("mfu") is not None:
        met = ty["mfu"] >= MFU_TARGET
        lines.append(f"- {'met' if met else 'MISS'}: MFU >= {MFU_TARGET:.0%} of the measured {ty['dtype']} peak: "
                     f"{ty['mfu']:.1%}")
    return lines


def notes(executed: list[Any]) -> list[str]:
    lines = []
    for run in executed:
        if run.error:
            lines.append(f"- {run.label} round {run.round + 1} FAILED: {run.error}")
            continue
        f = run.figures
        extra = ""
        if f.get("tokens_per_s_in_loop") is not None:
            extra += f", in-loop {f['tokens_per_s_in_loop']:.1f} tokens/s, padding {f['padding_share']:.0%}"
        if f.get("padding_free_check"):
            c = f["padding_free_check"]
            extra += (f", padding-free check: loss {c['padding_free']:.5f} vs padded {c['padded']:.5f} "
                      f"(|diff| {c['abs_diff']:.1e}: {'used' if c['ok'] else 'NOT used'})")
        kept = "" if run.round > 0 or f.get("kept", True) else " (not kept)"
        lines.append(f"- {run.label} round {run.round + 1}{kept}: {f['tokens_per_s']:.1f} real tokens/s, "
                     f"launch -> step 1 {f['launch_s']:.1f}s, eval loss {number(f.get('eval_loss'), '.4f')}, "
                     f"{run.seconds:.0f}s in all, load {run.load}{extra}")
    return lines


def report(**kw: Any) -> None:
    args, executed, repo = kw["args"], kw["executed"], kw["repo"]
    add_mfu(executed, kw["roofline"], kw["model_path"], kw["data"]["train"]["mean"])
    rows = combine(executed)
    peak = kw["roofline"]["peak_gflops"]
    header = [
        f"- machine: {bench_env.cpu_description()}; {bench_env.gpu_description()}",
        f"- commit: {bench_env.commit()}",
        f"- software: {bench_env.versions()}",
        f"- {kw['nproc']} processes x {kw['threads']} threads per run; {args.steps} optimizer steps of 8 samples; "
        f"{args.rounds} round(s), medians shown; LoRA r=8 alpha=16 on q/k/v/o/gate/up/down; lr 2e-4 cosine",
        f"- data: train {json.dumps(kw['data']['train'])}; eval {json.dumps(kw['data']['eval'])} "
        "(tokens per row: alpaca prompt + response + eos)",
        f"- measured matmul peak (machine total, GFLOP/s): fp32 {peak.get('fp32')}, bf16 {peak.get('bf16')} "
        f"(roofline.py: {json.dumps(kw['roofline']['flops'])})",
        f"- load average (1/5/15 min): {kw['load_start']} at the start, {kw['load_end']} at the end; waited "
        f"{kw['wait'][0]:.0f}s{'' if kw['wait'][1] else ' and never got quiet'}; 1-minute load while running: "
        f"{kw['load_during']}",
    ]
    body = [
        *table(rows),
        "",
        "Rows: " + "; ".join(f"`{name}`: {WHAT[name]}" for name in rows)
        + (f" (trainyard with {' '.join(args.trainyard_set)})" if getattr(args, "trainyard_set", None) else ""),
        "",
        "Targets for trainyard:",
        "",
        *misses(rows),
        "",
        "Every run:",
        "",
        *notes(executed),
    ]
    print("\n" + "\n".join(header + [""] + body))
    if args.no_record:
        return
    commands = sorted({" ".join(run.argv[1:]).replace(str(repo) + "/", "") for run in executed})
    section = [
        f"## bench.py: trainyard vs HF Trainer vs TRL — {bench_env.sh('date', '-u')}",
        "",
        *header,
        "",
        *body,
        "",
        "Commands (from the repository root; `python benchmarks/cpu/bench.py "
        + " ".join(a for a in (f"--steps {args.steps}", f"--rounds {args.rounds}")) + "` ran them):",
        "",
        "```",
        *[f"OMP_NUM_THREADS={kw['threads']} python {c}" for c in commands],
        "```",
        "",
        "",
    ]
    path = Path(args.results) if Path(args.results).is_absolute() else repo / args.results
    with open(path, "a") as handle:
        handle.write("\n" + "\n".join(section))
    print(f"\nappended to {args.results}")

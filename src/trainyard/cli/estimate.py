"""`trainyard estimate`: memory per device, step time and cost of a job before launching it."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from trainyard.cli.app import _config_and_overrides, app

_GPU_HELP = "h100-80gb, h100-pcie, h200, a100-80gb, a100-40gb, l4 or cpu"


@app.command("estimate")
def estimate_command(
    args: Annotated[list[str], typer.Argument(help="CONFIG (YAML file or preset name) then key=value overrides")],
    gpu: Annotated[str, typer.Option("--gpu", help=_GPU_HELP)] = "h100-80gb",
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="processes (GPUs) per node")] = 1,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes")] = 1,
    network_gbps: Annotated[
        Optional[float],
        typer.Option("--network-gbps", help="inter-node link per node, Gb/s (default: what dist.network and --gpu "
                     "imply, e.g. 3200 for h100-80gb nodes, 100 for dist.network: socket)"),
    ] = None,
    mfu: Annotated[
        Optional[float],
        typer.Option("--mfu", help="model FLOPs utilisation for step time (default: measured for the job's path "
                     "and GPU where it was, else 0.4 assumed; the step's line says which)"),
    ] = None,
    diloco_h: Annotated[int, typer.Option("--diloco-h", help="cross-node gradient sync every H steps")] = 1,
    disk_gbytes_s: Annotated[
        float, typer.Option("--disk-gbytes-s", help="checkpoint write bandwidth, GB/s")
    ] = 2.0,
    price_per_gpu_hour: Annotated[
        Optional[float], typer.Option("--price-per-gpu-hour", help="on-demand price of one GPU for one hour")
    ] = None,
    spot_discount: Annotated[
        float, typer.Option("--spot-discount", help="spot price = on-demand x (1 - this)")
    ] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="print every figure as JSON")] = False,
    trace: Annotated[
        bool,
        typer.Option("--trace", help="instead, run one real optimizer step on fake tensors and a fake process group "
                     "of the real world size: its peak per rank beside the formula's, and every collective (cut the "
                     "depth of a model.config job with an override: model.config.num_hidden_layers=2)"),
    ] = False,
) -> None:
    """Estimate memory per device (fits or not, and the cheapest fix), step time, job time and cost."""
    from trainyard import config_file as config_room
    from trainyard import estimate

    config_path, overrides = _config_and_overrides(args)
    hardware = estimate.Hardware(gpu, gpus_per_node, nodes, network_gbps)
    assumptions = estimate.Assumptions(mfu, diloco_h, disk_gbytes_s, price_per_gpu_hour, spot_discount)
    estimate.check_options(hardware, assumptions)  # before the model is built: bad options fail at once
    cfg = config_room.load_config(config_path, overrides)
    if trace:
        from trainyard.plan import context_parallel
        from trainyard.train import trace as step_trace
        from trainyard.train import trace_words

        traced = step_trace.trace(context_parallel(cfg, hardware)[0], hardware)  # auto: the size the plan takes
        print(json.dumps(trace_words.to_json(traced), indent=2) if as_json else trace_words.render(traced))
        return
    from trainyard.plan.reading import data_lengths

    from trainyard.plan.batching import micro_batch_tokens

    lengths = data_lengths(cfg, gpus_per_node * nodes)
    cfg, tokens_why = micro_batch_tokens(cfg, hardware, lengths)  # auto: the N the dry run and `train` take
    result = estimate.estimate(cfg, hardware, assumptions, lengths=lengths)
    if tokens_why:
        result.memory.notes.append(f"train.micro_batch_tokens auto -> {cfg.train.micro_batch_tokens:,}: {tokens_why}")
    print(json.dumps(estimate.to_json(result), indent=2) if as_json else estimate.render(result))

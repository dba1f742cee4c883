"""How close `trainyard estimate`'s memory model comes to what a real training step holds.

Each row builds the job as training does (`build.build_and_wrap`: meta model, LoRA, strategy, weights), runs
two real steps (forward, backward, AdamW) on CPU and measures the peak of live tensor bytes with `LiveBytes`, a
TorchDispatchMode that adds each new storage an operation returns and subtracts it when the storage is freed
and FSDP2 resizes in place (as PyTorch's MemTracker does; MemTracker itself hooks every parameter's gradient and
refuses frozen LoRA bases).
Tracking starts before the model is built, so DDP's buckets and FSDP2's shards count; the peak is reset once
the model and optimizer exist, so it is the training step's. Then it compares it with the estimate's peak tensor
bytes for the same job on `--gpu cpu` (no allocator slack or CUDA context there). Micro-batches are full:
`micro_batch_size` documents of `max_length` tokens each, every token a target, the bound the estimate assumes.
Beside it, the process's peak: the kernel's RSS high-water mark (VmHWM) of rank 0's process over its whole run,
imports and load included, minus nothing, under the malloc the launcher would preload (launch/allocator.py), against
the estimate's `peak` on `--gpu cpu` (live tensors + malloc retention + the runtime: what a CPU process holds).
Then the predictions for the seed jobs, which no CPU can measure.

    python benchmarks/memory/estimate_accuracy.py            # every row (a few minutes on 2 cores)
    python benchmarks/memory/estimate_accuracy.py --quick    # single-process rows only
    python benchmarks/memory/estimate_accuracy.py --only fsdp  # rows whose name contains "fsdp"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from trainyard.launch import allocator

REPO = Path(__file__).resolve().parents[2]
SMOL = ["model.path=builtin:smollm2-135m-instruct", "data.max_length=256", "train.micro_batch_size=2"]
TINY = [f"{REPO / 'configs' / 'tiny.yaml'}"]
# tiny-moe with expert stacks large next to its activations, so LoRA's folded expert weights show
MOE = [f"{REPO / 'configs' / 'tiny-moe.yaml'}", "model.config.n_routed_experts=32", "model.config.hidden_size=256",
       "model.config.moe_intermediate_size=512", "train.micro_batch_size=1", "data.max_length=64"]
ONE_STEP = ["train.global_batch_size=null", "dist.strategy=none"]
# name, config + overrides, processes
ROWS: list[tuple[str, list[str], int]] = [
    ("tiny full", [*TINY, *ONE_STEP], 1),
    ("tiny full, ckpt", [*TINY, *ONE_STEP, "model.gradient_checkpointing=true"], 1),
    ("smollm2 lora", ["quickstart", *SMOL, *ONE_STEP], 1),
    ("smollm2 lora, ckpt", ["quickstart", *SMOL, *ONE_STEP, "model.gradient_checkpointing=true"], 1),
    ("smollm2 full", ["quickstart", *SMOL, *ONE_STEP, "lora.enabled=false"], 1),
    ("smollm2 full, ckpt", ["quickstart", *SMOL, *ONE_STEP, "lora.enabled=false", "model.gradient_checkpointing=true"],
     1),
    ("smollm2 lora, fp32", ["quickstart", *SMOL, *ONE_STEP, "train.precision=fp32"], 1),
    ("smollm2 full, fp32", ["quickstart", *SMOL, *ONE_STEP, "lora.enabled=false", "train.precision=fp32"], 1),
    ("tiny-moe lora (big experts)", [*MOE, *ONE_STEP], 1),
    ("tiny-moe lora (big experts), ckpt", [*MOE, *ONE_STEP, "model.gradient_checkpointing=true"], 1),
    ("tiny full ddp x2", [*TINY, "train.global_batch_size=null", "dist.strategy=ddp"], 2),
    ("tiny full fsdp x2", [*TINY, "train.global_batch_size=null", "dist.strategy=fsdp"], 2),
    ("smollm2 lora fsdp x2", ["quickstart", *SMOL, "train.global_batch_size=null", "dist.strategy=fsdp"], 2),
    ("smollm2 full fsdp x2, ckpt", ["quickstart", *SMOL, "train.global_batch_size=null", "dist.strategy=fsdp",
                                    "lora.enabled=false", "model.gradient_checkpointing=true"], 2),
]
SEED_JOBS = [
    ("mistral-7b full, ddp 8x h100", ["configs/mistral7b-lora-ddp.yaml", "lora.enabled=false"], "h100-80gb", 8, 1),
    ("mistral-7b lora, ddp 8x h100", ["configs/mistral7b-lora-ddp.yaml"], "h100-80gb", 8, 1),
    ("glm-4.5-air lora, hsdp 2x8 h200", ["configs/glm45air-fsdp-lora.yaml"], "h200", 8, 2),
]


def full_batch(micro: int, length: int, vocab: int):  # type: ignore[no-untyped-def]
    """One padding-free micro-batch of `micro` documents of `length` tokens, every token a target."""
    ids = torch.randint(3, vocab, (1, micro * length))
    return {"input_ids": ids, "position_ids": torch.arange(length).repeat(micro)[None], "labels": ids.clone()}


class LiveBytes(TorchDispatchMode):
    """Live bytes of CPU tensor storages created under the mode, and their peak since `reset_peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, DTensor):  # its local ops run below this mode: count the local tensor here
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._add(tensor.untyped_storage())
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live or storage.nbytes() == 0 or not _allocated(storage):
            return
        self.live[key] = (storage.nbytes(), weakref.ref(storage, lambda _: self._free(key)))
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place (FSDP2 frees and re-allocates unsharded parameters so): count its new size."""
        key = id(storage)
        old, _ = self.live.pop(key, (0, None))
        self.current -= old
        self._add(storage)

    def _free(self, key: int) -> None:
        size, _ = self.live.pop(key, (0, None))
        self.current -= size

    def reset_peak(self) -> None:
        self.peak = self.current


def _allocated(storage: torch.UntypedStorage) -> bool:
    """Memory behind the storage: not a tensor subclass's wrapper (DTensor; its local tensor is counted) nor a
    storage whose data is not allocated (FSDP2's unsharded parameters before their first all-gather)."""
    try:
        return storage.data_ptr() != 0
    except RuntimeError:
        return False


def follow_fsdp_storage_resizes(tracker: LiveBytes) -> None:
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 (autograd may still hold the tensor) and
    re-allocates it by resizing back; a storage resize is no dispatched operation, so tell the tracker."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def following(resize):  # type: ignore[no-untyped-def]
        def resize_and_count(tensor: torch.Tensor) -> None:
            resize(tensor)
            tracker.resized(tensor.untyped_storage())

        return resize_and_count

    _fsdp_param.free_storage = following(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage = following(_fsdp_param.alloc_storage)
    _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage


def measure_rank(rank: int, world: int, args: list[str], out: str) -> None:
    """Build this rank's model as training does, run two steps under MemTracker, write the peak bytes."""
    import torch.distributed as torch_dist

    from trainyard import config_file as config_room
    from trainyard import dist
    from trainyard import precision as precision_room
    from trainyard.loss import token_loss_sum
    from trainyard.model import source as source_room
    from trainyard.train import build
    from trainyard.train.optim import build_optimizer

    device = torch.device("cpu")
    if world > 1:
        torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config_room.load_config(args[0], args[1:])
    precision = precision_room.resolve(cfg, device)
    info = dist.DistInfo(rank, world, rank, world, device, "gloo" if world > 1 else None)
    model_path = source_room.resolve_model_path(cfg.model) if cfg.model.path else None
    tokenizer = source_room.load_tokenizer(cfg.model, model_path)
    tracker = LiveBytes()
    follow_fsdp_storage_resizes(tracker)
    with tracker:
        model, strategy, _ = build.build_and_wrap(cfg, info, precision, model_path, tokenizer)
        optimizer, _ = build_optimizer(model, cfg)
        vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
        torch.manual_seed(rank)
        tracker.reset_peak()
        for _ in range(2):
            batch = full_batch(cfg.train.micro_batch_size, cfg.data.max_length, vocab)
            with precision_room.autocast(precision, device):
                loss, _ = token_loss_sum(model, batch, device)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = tracker.peak
    process_peak = process_high_water()
    Path(f"{out}.{rank}").write_text(json.dumps({"peak": peak, "process_peak": process_peak, "strategy": strategy,
                                                 "precision": precision.name}))
    if world > 1:
        torch_dist.destroy_process_group()


def process_high_water() -> int:
    """This process's RSS high-water mark (VmHWM) in bytes: its peak over the whole run."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status: the process peak needs Linux")


def measure(args: list[str], world: int) -> dict:
    """Rank 0's measured peak (every rank holds the same share), from fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "peak")
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731", "OMP_NUM_THREADS": "1",
               **allocator.preload_env(os.environ)}
        procs = [
            subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--out", out, *args],
                             env=env, cwd=REPO)
            for r in range(world)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit(f"measuring {args} failed")
        return json.loads(Path(f"{out}.0").read_text())


def predict(args: list[str], gpu: str, gpus_per_node: int, nodes: int):  # type: ignore[no-untyped-def]
    """The estimate of a job on a layout, from the same config and overrides as the measurement."""
    from trainyard import config_file as config_room
    from trainyard import estimate

    cfg = config_room.load_config(args[0], args[1:])
    return estimate.estimate(cfg, estimate.Hardware(gpu, gpus_per_node, nodes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="single-process rows only")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--only", help="rows whose name contains this")
    parser.add_argument("--measured", type=Path,
                        help="a JSON file of measured rows: read it where it has the row (no run), else add the row")
    known, rest = parser.parse_known_args()
    if known.rank is not None:
        measure_rank(known.rank, known.world, rest, known.out)
        return
    print(f"malloc: {allocator.preload_env(os.environ).get('LD_PRELOAD', 'glibc')}; MiB per rank; "
          "live: peak of live tensor bytes in the step; process: VmHWM over the whole run")
    print(f"{'job':36} {'strategy':8} {'precision':10} {'live pred':>9} {'meas':>7} {'error':>7}  "
          f"{'process pred':>12} {'meas':>7} {'error':>7}")
    for name, args, world in ROWS:
        if (known.quick and world > 1) or (known.only and known.only not in name):
            continue
        saved = json.loads(known.measured.read_text()) if known.measured and known.measured.is_file() else {}
        measured = saved.get(name) or measure(args, world)
        if known.measured:
            known.measured.write_text(json.dumps({**saved, name: measured}, indent=1))
        memory = predict(args, "cpu", world, 1).memory
        live, process = memory.peak_tensor_bytes, memory.peak
        error = (live - measured["peak"]) / measured["peak"]
        process_error = (process - measured["process_peak"]) / measured["process_peak"]
        print(f"{name:36} {measured['strategy']:8} {measured['precision']:10} {live / 2**20:9.1f} "
              f"{measured['peak'] / 2**20:7.1f} {error:+7.1%}  {process / 2**20:12.1f} "
              f"{measured['process_peak'] / 2**20:7.1f} {process_error:+7.1%}", flush=True)
    print()
    for name, args, gpu, per_node, nodes in SEED_JOBS:
        result = predict(args, gpu, per_node, nodes)
        verdict = "fits" if result.fits else "does NOT fit"
        gib = 2**30
        print(f"{name:34} {result.layout.strategy:5} peak {result.memory.peak / gib:6.1f} GiB of "
              f"{result.device_bytes / gib:.1f} GiB: {verdict} (margin {result.margin_bytes / gib:+.1f} GiB)")


if __name__ == "__main__":
    main()

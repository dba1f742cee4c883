"""How long before the kill a stop signal must come: enough to finish the step under way and commit a full
checkpoint. `trainyard slurm` makes it the lead of `--signal`, `trainyard k8s` the pod's grace period; both from
trainyard's estimate of this job at this world size and device kind (a 70B full save takes minutes, not the 80 s a
fixed lead gave), with a margin."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainyard.config import JobConfig
from trainyard.errors import ConfigError, ModelError, OptionError

MIN_SAVE_WINDOW_S = 80
"""The least time workers get to finish a step and save after the signal, however small the job."""
SAVE_MARGIN = 1.5
SAVE_MARGIN_S = 30
"""The save window is the estimated step + full save times this factor, plus these seconds: the estimate assumes
a disk bandwidth it has not measured."""


@dataclass(frozen=True)
class SignalLead:
    seconds: int
    """From the signal to the kill."""
    reason: str
    margin_s: int
    """What the launcher keeps for its own exit: it kills the workers this long before the kill comes."""
    step_s: float | None = None
    """One step's estimated time; None where the lead was given, not estimated."""

    @property
    def save_window_s(self) -> int:
        """What the workers get (torchrun's shutdown timeout): the lead less the launcher's own margin."""
        return self.seconds - self.margin_s


def estimated_lead(
    cfg: JobConfig, kind: str, nproc_per_node: int, nodes: int, margin_s: int, flag: str, kind_note: str = ""
) -> SignalLead:
    """The lead for `kind` nodes: (the steps a stop may wait for + a full save) x SAVE_MARGIN + SAVE_MARGIN_S, at
    least MIN_SAVE_WINDOW_S, for the workers, + `margin_s` for the launcher. `flag` is the option that overrides it.
    """
    from trainyard.estimate import Hardware, estimate
    from trainyard.estimate.timing import DEFAULT_DISK_GBYTES_S

    try:
        timing = estimate(cfg, Hardware(kind, nproc_per_node, nodes), suggest=False).timing
    except (ModelError, ConfigError) as err:
        raise OptionError(
            f"cannot estimate the full checkpoint's save time for the preemption signal: {err.what}",
            fix=f"pass {flag} SECONDS: more than one step plus one full save",
        ) from None
    # Under DiLoCo a stop takes effect at the round's outer sync (sites agree only there): up to sync_every steps.
    steps = cfg.diloco.sync_every if cfg.dist.strategy == "diloco" else 1
    window = max(MIN_SAVE_WINDOW_S, math.ceil(SAVE_MARGIN * (steps * timing.step_s + timing.save_s)) + SAVE_MARGIN_S)
    rounds = f"{steps} steps (to the round's outer sync) x " if steps > 1 else ""
    reason = (
        f"estimated by trainyard for {nodes} x {nproc_per_node} {kind}{kind_note}: {rounds}a step "
        f"{timing.step_s:.3g} s + a full save {timing.save_s:.3g} s ({timing.checkpoint_bytes / 1e9:.3g} GB at "
        f"{DEFAULT_DISK_GBYTES_S:g} GB/s), x{SAVE_MARGIN:g} + {SAVE_MARGIN_S} s (at least {MIN_SAVE_WINDOW_S} s) "
        f"for the workers, + {margin_s} s for the agent; {flag} N overrides"
    )
    return SignalLead(window + margin_s, reason, margin_s, timing.step_s)

"""A fault-tolerant DiLoCo site that healed from a live peer goes on from what the peer lent it at the sync (the loop's
part of it: step, data position, schedule, random streams); the inner optimizer state is test_diloco_ft.py's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from trainyard.config import JobConfig
from trainyard.data import ResumableSampler
from trainyard.train.optim import build_optimizer
from trainyard.train.recipe import _loop_facts
from trainyard.train.rounds import SiteRounds
from trainyard.train.state import LoopState


def site() -> SimpleNamespace:
    """What `_loop_facts` and `_take_heal` read of a job, real but for the outer sync and the metrics sink."""
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 1), JobConfig())
    return SimpleNamespace(sampler=ResumableSampler(16, seed=0, rank=0, world_size=1), optimizer=optimizer,
                           scheduler=scheduler, outer=SimpleNamespace(),
                           sink=SimpleNamespace(emit=lambda *_, **__: None))


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_healed_site_goes_on_from_its_peers_step_schedule_and_random_streams() -> None:
    peer, healing = site(), site()
    for _ in range(5):  # steps without gradients: only the schedule moves
        peer.optimizer.step()
        peer.scheduler.step()
    lent = {"step": 7, **_loop_facts(peer)}
    expected = draws()  # what the peer draws next
    draws()  # the healing site's own streams are elsewhere
    healing.across = SimpleNamespace(healed=lent, start_norm=lambda: 0.0, inner_fingerprint=lambda: 0.0)
    state = LoopState(step=2)
    assert SiteRounds(healing)._take_heal(state, 2) == state.step == 7
    assert draws() == expected
    assert [g["lr"] for g in healing.optimizer.param_groups] == peer.scheduler.get_last_lr()

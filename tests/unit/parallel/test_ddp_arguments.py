"""DDP's arguments across the torch versions trainyard supports (torch>=2.11): the one that keeps eval forwards free
of buffer broadcasts was renamed in torch 2.13, and torch 2.11 refuses the new name (seen on a GPU)."""

from __future__ import annotations

import inspect

from torch.nn.parallel import DistributedDataParallel

from trainyard.parallel.parallelize import no_buffer_sync_in_forward


def test_the_installed_torch_s_ddp_takes_the_argument_chosen_for_it():
    chosen = no_buffer_sync_in_forward(DistributedDataParallel)
    assert list(chosen.values()) == [False]
    assert set(chosen) <= set(inspect.signature(DistributedDataParallel).parameters)


def test_a_torch_before_2_13_gets_broadcast_buffers():
    class DistributedDataParallelOfTorch211:  # its __init__'s signature, which has no forward_sync_buffers
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                     process_group=None, bucket_cap_mb=None, find_unused_parameters=False, init_sync=True):
            pass

    assert no_buffer_sync_in_forward(DistributedDataParallelOfTorch211) == {"broadcast_buffers": False}

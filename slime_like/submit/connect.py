"""The job's own connection to Ray: the cluster it was submitted to, or a local one.

A local cluster on a machine without GPUs declares as many GPUs as the placement group
has bundles, so placement runs the same code it runs on a GPU cluster.
"""

from __future__ import annotations

import os

import ray


def init_ray(num_bundles: int) -> None:
    """Join the cluster this job was submitted to (`RAY_ADDRESS`), or start a local one with
    room for `num_bundles` placement bundles."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=True)
        return
    try:
        import torch

        has_gpus = torch.cuda.is_available()
    except ImportError:
        has_gpus = False
    # address="local": a new cluster of our own, never one that `ray start` left running
    ray.init(address="local", num_cpus=max(4, num_bundles + 2),
             num_gpus=None if has_gpus else num_bundles, include_dashboard=False,
             log_to_driver=True)

"""A small elastic training program: a linear regression trained with DDP.

Run it under torchrun (``torchrun -m phalanx.worker.demo --steps 200``). It prints one
line per logged step (``step=N loss=X world_size=W rank=R``), which the end-to-end tests
read to prove that all workers joined one world and that the loss went down.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> int:
    """Train, logging progress to stdout."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (slows the demo)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.worker.backend import choose_backend

    dist.init_process_group(backend=choose_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"phalanx-demo: joined rank={rank} world_size={world} attempt={os.environ.get('PHALANX_ATTEMPT', '?')}",
        flush=True,
    )
    torch.manual_seed(0)
    true_weight = torch.tensor([[2.0, -3.0, 0.5, 1.0]])
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):
        inputs = torch.randn(32, 4, generator=generator)
        targets = inputs @ true_weight.T + 0.7
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == 1:
            print(f"phalanx-demo: step={step} loss={loss.item():.6f} world_size={world} rank={rank}", flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    dist.barrier()
    print(f"phalanx-demo: done rank={rank} world_size={world}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

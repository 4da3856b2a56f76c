"""A small elastic training program: a linear regression trained with DDP over gloo or NCCL.

Run it under torchrun (``torchrun -m phalanx.worker.demo --steps 200``). It resumes from the
latest complete checkpoint when the operator configured one, and prints one line per logged
step (``step=N loss=X world_size=W rank=R``), which the end-to-end tests read to prove that all
workers joined one world, that the loss went down and that a restarted gang resumed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Train, logging progress to stdout."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (slows the demo)")
    args = parser.parse_args(argv)

    if os.environ.get("PHALANX_REPLICA_GROUP") is not None:
        return train_in_groups(args.steps, args.log_every, args.step_seconds)

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.worker.session import TrainingSession

    print(f"phalanx-demo: imported torch pid={os.getpid()}", flush=True)  # the recovery benchmark's marker
    with TrainingSession(checkpoint_every=args.checkpoint_every) as session:
        rank, world = session.rank, session.world_size
        print(
            f"phalanx-demo: joined rank={rank} world_size={world} attempt={os.environ.get('PHALANX_ATTEMPT', '?')}",
            flush=True,
        )
        torch.manual_seed(0)
        true_weight = torch.tensor([[2.0, -3.0, 0.5, 1.0]])
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        state = {"model": model, "optimizer": optimizer}
        batch = 32
        for step in session.steps(args.steps, state, samples_per_step=batch * world):
            if step == (session.resumed_from or 0) + 1:
                print(f"phalanx-demo: starting at step={step} resumed_from={session.resumed_from}", flush=True)
            generator = torch.Generator().manual_seed(step * 1000 + rank)
            inputs = torch.randn(batch, 4, generator=generator)
            targets = inputs @ true_weight.T + 0.7
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if step % args.log_every == 0 or step == 1:
                print(f"phalanx-demo: step={step} loss={loss.item():.6f} world_size={world} rank={rank}", flush=True)
            if args.step_seconds:
                time.sleep(args.step_seconds)
        print(f"phalanx-demo: done rank={rank} world_size={world} steps={args.steps}", flush=True)
    return 0


def train_in_groups(steps: int, log_every: int, step_seconds: float) -> int:
    """The demo in a replica group (spec.replicaGroups): DDP inside the group's torchrun world,
    the per-step quorum across groups (``phalanx.worker.replica_groups``). Every step taken prints
    ``step=N loss=X group=G members=...``; a group that joins a running job prints where it joined
    and the step it healed at (that step's loss is the healed weights', taken from a peer group)."""
    # before torch's import: how long a returning group takes to start shows in the log's stamps
    print(f"phalanx-demo: group={os.environ['PHALANX_REPLICA_GROUP']} process started", flush=True)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.worker.replica_groups import ReplicaGroupTrainer

    group = int(os.environ["PHALANX_REPLICA_GROUP"])
    grouped = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if grouped:
        dist.init_process_group("gloo")
        print(f"phalanx-demo: group={os.environ['PHALANX_REPLICA_GROUP']} in its group's world (gloo)", flush=True)
    rank = dist.get_rank() if grouped else 0
    torch.manual_seed(0)  # every group starts from the same weights, as DDP's ranks do
    model: torch.nn.Module = torch.nn.Linear(4, 1)
    if grouped:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = ReplicaGroupTrainer.from_env(model, optimizer)
    assert trainer is not None
    print(f"phalanx-demo: group={group} rank={rank} connected to the job's store", flush=True)
    step = trainer.start()
    print(f"phalanx-demo: group={group} rank={rank} starting at step={step}", flush=True)
    true_weight = torch.tensor([[2.0, -3.0, 0.5, 1.0]])
    while step <= steps:
        generator = torch.Generator().manual_seed(step * 1000 + group * 10 + rank)
        inputs = torch.randn(32, 4, generator=generator)
        targets = inputs @ true_weight.T + 0.7
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        step = trainer.step(step)
        if trainer.healed_at == step:
            print(f"phalanx-demo: group={group} healed at step={step} from a peer group", flush=True)
            with torch.no_grad():  # the loss above was the replaced weights': print the peer's
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.step()
        if step % log_every == 0 or step == 1:
            members = ",".join(str(one) for one in trainer.members)
            print(f"phalanx-demo: step={step} loss={loss.item():.6f} group={group} members={members}", flush=True)
        if step_seconds:
            time.sleep(step_seconds)
        step += 1
    print(f"phalanx-demo: done group={group} rank={rank} steps={steps}", flush=True)
    return 0


def exit_now(code: int) -> None:
    """End the process without interpreter finalization.

    After ``destroy_process_group`` gloo's worker and transport threads (and, on rank 0, the
    TCPStore server thread) live on until the objects that still hold the group (DDP, the
    optimizer, autograd state) are destroyed, which happens during finalization; a native thread
    that touches a Python object then aborts the process ("terminate called without an active
    exception", exit -6) after training has succeeded. The session has already torn down
    collectively and recorded completion, so nothing is left to clean up.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

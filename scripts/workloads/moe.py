"""A mixture-of-experts layer with expert parallelism: one expert per rank, top-1
gating, tokens dispatched and combined with uneven ``all_to_all_single`` (the counts
exchanged first with an even one, as MoE layers do), the gate's gradients averaged
with ``all_reduce``, the loss logging all_reduce.

torchrun --standalone --nproc-per-node 4 scripts/workloads/moe.py [--fault splits]

Fault ``splits``: at the fault step the rank dispatches with ``input_split_sizes``
that disagree with the counts it announced (one token moved from one expert's share
to another's) — what its peers expect from it is not what it sends.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, finish, parse_args, setup

TOKENS = 16
DIM = 8


def dispatch(x: torch.Tensor, expert: torch.Tensor, world: int, fault: Fault,
             step: int) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """Send each token to its expert's rank; returns (received tokens, send splits,
    receive splits, the order the tokens were sent in)."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=world)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)  # every rank announces its counts
    send = counts.tolist()
    recv = recv_counts.tolist()
    if fault.now(step) and fault.kind == "splits":
        # one token moved from one peer's share to another's, unannounced (its own
        # share kept: gloo checks that one locally and raises at once)
        me = dist.get_rank()
        src = next(i for i, c in enumerate(send) if c > 0 and i != me)
        dst = next(i for i in range(world) if i not in (me, src))
        send[src] -= 1
        send[dst] += 1
    out = torch.empty(sum(recv), x.shape[1])
    dist.all_to_all_single(out, x[order].contiguous(), output_split_sizes=recv,
                           input_split_sizes=send)
    return out, send, recv, order


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, world = setup()
    fault = Fault(args, rank)
    gate = nn.Linear(DIM, world)
    expert_net = nn.Linear(DIM, DIM)
    for p in gate.parameters():  # every rank starts from rank 0's gate
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD([*gate.parameters(), *expert_net.parameters()], lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(args.steps):
        fault.start_of_step(step)
        x = torch.randn(TOKENS, DIM, generator=gen)
        logits = gate(x)
        expert = logits.argmax(dim=1)
        mine, send, recv, order = dispatch(x, expert, world, fault, step)
        y = expert_net(mine)
        back = torch.empty(TOKENS, DIM)
        dist.all_to_all_single(back, y.detach().contiguous(), output_split_sizes=send,
                               input_split_sizes=recv)
        combined = torch.empty_like(back)
        combined[order] = back
        weight = torch.softmax(logits, dim=1).gather(1, expert[:, None])
        loss = nn.functional.mse_loss(weight * combined, x) + nn.functional.mse_loss(y, mine)
        opt.zero_grad()
        loss.backward()
        for p in gate.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses.append(fault.log_loss(loss, step))
    finish(rank, losses)


if __name__ == "__main__":
    main()

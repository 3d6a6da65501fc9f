"""A data-parallel step for the trace test: forward, backward, gradient all-reduce through
minispeed.comm inside a `comm.*`-named range, an optimizer step; run by `python -m
minispeed.profiler trace` (not a test module itself)."""

import torch
from torch import nn

import minispeed.comm as comm
from minispeed import profiler

comm.init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(2):
    with profiler.traced_step():
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        with profiler.range("comm.all_reduce"):
            comm.all_reduce(flat)
        opt.step()
        opt.zero_grad()
comm.destroy_process_group()

"""A data-parallel step for the trace test: forward, then backward and the gradient
all-reduce (through minispeed.comm, which marks it `comm.all_reduce`) inside a phase range named
as minispeed.zero names its own (`zero.backward`), an optimizer step; run by `python -m
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
        with profiler.range("zero.backward"):  # a phase: its matmuls are compute
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            comm.all_reduce(flat)
        opt.step()
        opt.zero_grad()
comm.destroy_process_group()

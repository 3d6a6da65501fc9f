"""The small model whose DeepSpeed 0.19.8 flops-profiler counts are recorded in
`fixtures/deepspeed_flops_profile.json` (by `fixtures/record_deepspeed_flops.py`): a
convolution, a ReLU, an MLP head with a LayerNorm and a GELU, a softmax. Imports torch only, so
the DeepSpeed venv and ours build the same model."""

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (2, 3, 8, 8)


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Sequential(
            nn.Linear(8 * 8 * 8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 10)
        )

    def forward(self, x):
        y = self.act(self.conv(x)).flatten(1)
        return F.softmax(self.head(y), dim=-1)


def build():
    torch.manual_seed(0)
    return SmallNet()

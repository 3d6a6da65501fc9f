"""Stages exchange tuples holding a tensor that requires grad and one that does not (a bool mask):
every schedule trains like the unsplit model, and only the hidden state's gradient goes back."""

import torch
from pipeline_testlib import masked_model, reference, train_pipeline

from minispeed.core.testing import run_distributed

SCHEDULES = [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("gpipe", 1)]


def _train_all(rank, world_size):
    return {
        name: train_pipeline(rank, world_size, 2, name, 3, 8, 4, v, model="masked")
        for name, v in SCHEDULES
    }


def test_tuple_messages_with_a_no_grad_mask_match_the_unsplit_model():
    ref_losses, ref_params = reference(masked_model(4), 3, 8)
    for per_schedule in run_distributed(_train_all, world_size=2):
        for name, res in per_schedule.items():
            torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=0, msg=name)
            for key, value in res["params"].items():
                torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6, msg=key)

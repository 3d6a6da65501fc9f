"""eval_batch runs forwards only and returns the unsplit model's loss; a checkpointed stage
trains to the same parameters as an ordinary one."""

import torch
from pipeline_testlib import data, lm_loss, reference, stage_params, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed


def _eval_and_checkpointed_train(rank, world_size):
    module = pp.partition(tiny_gpt(4), stages=world_size, loss_fn=lm_loss, method="type:Block",
                          activation_checkpointing=True)  # fmt: skip
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.05), micro_batches=4)
    before = [p.detach().clone() for p in module.parameters()]
    eval_loss = ex.eval_batch(*data(1, 8, seed=7)[0])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    losses = [ex.train_batch(x, y) for x, y in data(3, 8)]
    return eval_loss, unchanged, losses, stage_params(module)


def test_eval_and_checkpointed_training_match_the_unsplit_model():
    model = pp.build_unsplit(tiny_gpt(4))
    x, y = data(1, 8, seed=7)[0]
    with torch.no_grad():
        want_eval = lm_loss(model(x), y).item()
    ref_losses, ref_params = reference(tiny_gpt(4), 3, 8)
    for eval_loss, unchanged, losses, params in run_distributed(
        _eval_and_checkpointed_train, world_size=2
    ):
        assert unchanged
        torch.testing.assert_close(eval_loss, want_eval, rtol=1e-5, atol=0)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        for key, value in params.items():
            torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6)


def _eval_outputs(rank, world_size):
    module = pp.partition(tiny_gpt(4), stages=world_size, loss_fn=lm_loss, method="type:Block")
    ex = pp.PipelineExecutor(module, None, micro_batches=4)
    x, y = data(1, 8, seed=7)[0]
    outputs = ex.eval_outputs(x, y, compute_loss=False)
    # two micro-batches of the same size (the activations' negotiated shape), not four
    losses = ex.eval_outputs(x[:4], y[:4], micro_batches=2)
    two = ex.eval_batch(x[:4], y[:4], micro_batches=2)
    return outputs, losses, two, ex.micro_batches


def test_eval_outputs_are_the_unsplit_models_per_micro_batch():
    """`eval_outputs`: the model's outputs (compute_loss=False) or each micro-batch's loss, in
    order, on the last stage only; `micro_batches=` splits one batch differently, once."""
    model = pp.build_unsplit(tiny_gpt(4))
    x, y = data(1, 8, seed=7)[0]
    with torch.no_grad():
        want_outputs = list(model(x).chunk(4))
        want_losses = [lm_loss(model(a), b).item() for a, b in zip(x[:4].chunk(2), y[:4].chunk(2))]
    first, last = run_distributed(_eval_outputs, world_size=2)
    assert first[:2] == (None, None) and first[3] == last[3] == 4
    torch.testing.assert_close(last[0], want_outputs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([v.item() for v in last[1]], want_losses, rtol=1e-5, atol=0)
    for two in (first[2], last[2]):
        torch.testing.assert_close(two, sum(want_losses) / 2, rtol=1e-5, atol=0)

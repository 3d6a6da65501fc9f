"""Cutting layer specs into stages: each method's cut, the stage's own layers only, clear errors."""

import pytest
import torch
from pipeline_testlib import Block, tiny_gpt
from torch import nn

import minispeed.pipeline as pp
from minispeed.pipeline import LayerSpec, TiedLayerSpec


def test_uniform_cut():
    assert pp.layer_boundaries([LayerSpec(nn.ReLU)] * 10, 4, "uniform") == [0, 2, 5, 7, 10]


def test_parameters_cut_balances_parameter_counts():
    # parameter counts: 10·10+10=110, 2·110·... a big layer alone on one stage
    layers = [LayerSpec(nn.Linear, (10, 10))] * 3 + [LayerSpec(nn.Linear, (100, 100))]
    assert pp.layer_boundaries(layers, 2, "parameters") == [0, 3, 4]
    # one wide layer then small ones: the wide one stands alone
    layers = [LayerSpec(nn.Linear, (100, 100))] + [LayerSpec(nn.Linear, (10, 10))] * 6
    assert pp.layer_boundaries(layers, 2, "parameters") == [0, 1, 7]


def test_type_cut_spreads_the_matching_layers():
    layers = tiny_gpt(blocks=4)  # embed, 4 blocks, head
    b = pp.layer_boundaries(layers, 2, "type:block")  # case-insensitive
    assert b[0] == 0 and b[-1] == 6
    assert [
        sum(1 for i in range(b[k], b[k + 1]) if layers[i].name == "Block") for k in range(2)
    ] == [2, 2]


def test_the_parameter_count_allocates_nothing():
    class Huge(nn.Linear):
        def __init__(self):
            super().__init__(50_000, 50_000)  # 10 GB in fp32 if it were allocated

    assert pp.layer_boundaries([LayerSpec(Huge), LayerSpec(nn.ReLU)], 2, "parameters") == [0, 1, 2]


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(pp.PartitionError, match=r"4 stages .* only 3 layers"):
        pp.layer_boundaries([LayerSpec(nn.ReLU)] * 3, 4, "uniform")


def test_a_stage_left_empty_is_an_error():
    with pytest.raises(pp.PartitionError, match="leave part 1 empty"):
        pp.layer_boundaries([LayerSpec(nn.ReLU)] * 4, 3, [0, 2, 2, 4])
    with pytest.raises(pp.PartitionError, match="positive weight"):
        pp.layer_boundaries(tiny_gpt(blocks=2), 3, "type:Block")
    with pytest.raises(pp.PartitionError, match="unknown partition method"):
        pp.layer_boundaries(tiny_gpt(blocks=2), 2, "flops")


def test_unsplit_model_shares_tied_weights_and_seeds_each_layer():
    model = pp.build_unsplit(tiny_gpt(blocks=2))
    again = pp.build_unsplit(tiny_gpt(blocks=2))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    assert sum(1 for _ in model.parameters()) == 1 + 2 * 4  # one embedding, 2 blocks of 2 Linear
    assert isinstance(model.layers["1"], Block)


def test_a_type_regex_that_matches_nothing_says_so():
    with pytest.raises(pp.PartitionError, match=r"'type:Nope'.*matched no layer class.*'Block'"):
        pp.layer_boundaries(tiny_gpt(blocks=2), 2, "type:Nope")


def test_deepspeed_argument_order_in_layer_specs_is_refused_with_the_fix():
    # DeepSpeed writes TiedLayerSpec("embed", nn.Embedding, vocab, d) and LayerSpec(nn.Linear, 8, 8)
    with pytest.raises(TypeError, match=r"class \(or factory\) first.*key=\.\.\."):
        TiedLayerSpec("embed", nn.Embedding, (16, 8))
    with pytest.raises(TypeError, match=r"one tuple.*args=8"):
        LayerSpec(nn.Linear, 8, 8)

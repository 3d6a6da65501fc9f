"""Sparsity layouts: DeepSpeed's keys, the exact tiles each mode keeps, and refused input."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference.sparse import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    block_sparse_attention,
    check_layout,
    draw_layout,
    layout_density,
)


def test_fixed_layout_is_local_windows_plus_the_last_block_of_each_as_global():
    layout = FixedSparsityConfig(2, block=4, num_local_blocks=4).make_layout(32)
    assert draw_layout(layout, 0) == "\n".join(
        ["####...#", "####...#", "####...#", "####...#",
         "...#####", "...#####", "...#####", "...#####"]
    )  # fmt: skip
    assert torch.equal(layout[0], layout[1])  # one layout copied to every head


def test_fixed_unidirectional_is_causal_and_horizontal_global_adds_rows():
    uni = FixedSparsityConfig(1, block=4, num_local_blocks=4, attention="unidirectional")
    assert draw_layout(uni.make_layout(32)) == "\n".join(
        ["#.......", "##......", "###.....", "####....",
         "...##...", "...###..", "...####.", "...#####"]
    )  # fmt: skip
    layout = uni.make_layout(32)[0]
    assert torch.equal(layout, torch.tril(layout))
    assert layout[7].tolist() == [False, False, False, True, True, True, True, True]
    horizontal = FixedSparsityConfig(
        1, block=4, num_local_blocks=4, horizontal_global_attention=True
    ).make_layout(32)[0]
    assert horizontal[3].all() and horizontal[7].all()


def test_sliding_window_and_bigbird_globals():
    local = LocalSlidingWindowSparsityConfig(1, block=2, num_sliding_window_blocks=3)
    assert draw_layout(local.make_layout(10)) == "#....\n##...\n.##..\n..##.\n...##"
    bb = BigBirdSparsityConfig(1, block=2, num_random_blocks=0, num_global_blocks=1)
    layout = bb.make_layout(12)[0]
    assert layout[0].all() and layout[:, 0].all()  # global row and column
    for r in range(6):  # the centred window of 3
        assert layout[r, max(0, r - 1) : r + 2].all()
    assert draw_layout(bb.make_layout(12)) == "\n".join(
        ["######", "###...", "####..", "#.###.", "#..###", "#...##"]
    )


def test_random_blocks_are_seeded_and_per_head_when_asked():
    cfg = BigBirdSparsityConfig(4, block=1, num_random_blocks=2, different_layout_per_head=True)
    a, b = cfg.make_layout(40), cfg.make_layout(40)
    assert torch.equal(a, b)  # a pure function of the config: every rank agrees
    assert not torch.equal(a[0], a[1])
    other = BigBirdSparsityConfig(
        4, block=1, num_random_blocks=2, different_layout_per_head=True, seed=1
    )
    assert not torch.equal(other.make_layout(40), a)
    var = VariableSparsityConfig(1, block=1, num_random_blocks=3, local_window_blocks=(1,),
                                 global_block_indices=(), attention="unidirectional")  # fmt: skip
    layout = var.make_layout(16)[0]
    assert torch.equal(layout, torch.tril(layout))
    assert (layout.sum(-1)[3:] >= 3).all() and (layout.sum(-1) <= 4).all()


def test_variable_windows_and_global_ranges():
    cfg = VariableSparsityConfig(
        1, block=1, local_window_blocks=(1, 2), global_block_indices=(5,),
        global_block_end_indices=(7,), horizontal_global_attention=True,
    )  # fmt: skip
    layout = cfg.make_layout(8)[0]
    assert layout[0, 0] and layout[1:3, 1:3].all() and layout[3:5, 3:5].all()
    assert layout[:, 5:7].all() and layout[5:7, :].all()


def test_from_section_translates_deepspeed_keys():
    cfg = SparsityConfig.from_section(
        {"mode": "fixed", "block": 32, "different_layout_per_head": True, "num_local_blocks": 8,
         "num_global_blocks": 2, "attention": "unidirectional", "num_different_global_patterns": 2},
        num_heads=6,
    )  # fmt: skip
    assert cfg == FixedSparsityConfig(6, 32, True, 8, 2, "unidirectional", False, 2)
    bsl = SparsityConfig.from_section(
        {"mode": "bslongformer", "num_sliding_window_blocks": 5, "global_block_indices": [0, 4]},
        num_heads=2,
    )
    assert bsl == BSLongformerSparsityConfig(
        2, num_sliding_window_blocks=5, global_block_indices=(0, 4)
    )
    assert isinstance(
        SparsityConfig.from_section({"mode": "dense"}, num_heads=1), DenseSparsityConfig
    )
    assert isinstance(
        SparsityConfig.from_section({"mode": "bigbird"}, num_heads=1), BigBirdSparsityConfig
    )
    assert isinstance(
        SparsityConfig.from_section({"mode": "variable"}, num_heads=1), VariableSparsityConfig
    )
    with pytest.raises(
        ValueError, match=r"sparse_attention.num_random_blocks: unknown key.*mode 'fixed'"
    ):
        SparsityConfig.from_section({"mode": "fixed", "num_random_blocks": 1}, num_heads=2)
    with pytest.raises(ValueError, match=r"^sparse_attention.mode: 'sparse' is unknown"):
        SparsityConfig.from_section({"mode": "sparse"}, num_heads=2)


def test_bad_configs_and_lengths_raise_with_the_fix():
    with pytest.raises(ValueError, match="must divide num_local_blocks"):
        FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="attention must be one of"):
        FixedSparsityConfig(1, attention="causal")
    with pytest.raises(ValueError, match="needs attention='bidirectional'"):
        FixedSparsityConfig(1, attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match=r"not a multiple of the sparsity block 16: pad .* by 6"):
        FixedSparsityConfig(1).make_layout(90)
    with pytest.raises(ValueError, match="exceeds the 4 blocks"):
        BigBirdSparsityConfig(1, block=4, num_random_blocks=5).make_layout(16)


def test_a_layout_with_an_empty_row_is_refused():
    layout = torch.ones(3, 4, 4, dtype=torch.bool)
    layout[2, 1] = False
    with pytest.raises(ValueError, match="row 1 of head 2 keeps no key block"):
        check_layout(layout)
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="attend to nothing"):
        block_sparse_attention(q, q, q, layout, 2)
    upper = torch.triu(torch.ones(1, 4, 4, dtype=torch.bool), diagonal=1)
    upper[0, 0, 0] = True
    with pytest.raises(ValueError, match="row 1 of head 0 keeps no key block on or below"):
        check_layout(upper, causal=True)


def test_density_counts_kept_tiles():
    layout = LocalSlidingWindowSparsityConfig(2, block=4).make_layout(64)  # 16 blocks, window 2
    assert layout_density(layout) == pytest.approx((16 + 15) / 256)
    assert layout_density(DenseSparsityConfig(2).make_layout(64)) == 1.0
    assert layout_density(DenseSparsityConfig(2).make_layout(64), causal=True) == pytest.approx(
        (4 * 5 / 2) / 16
    )

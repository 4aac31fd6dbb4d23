"""unifusion.block_partition: where a block model's blocks start, for each declared block origin."""

from __future__ import annotations

import pytest
import torch

from unifusion.block_partition import (
    aligning_shifts,
    block_origin_of,
    first_block_start,
    origin_columns,
    shift_left,
    shift_right,
)


def test_origins_and_first_blocks_of_left_padded_rows() -> None:
    """Three rows of 10 columns: a prompt of 6 unpadded, a prompt of 3 behind 3 pads, a prompt of 5 behind 1 pad;
    the completion from column 6 in every row. Blocks of 4."""
    valid = torch.tensor([[True] * 10, [False] * 3 + [True] * 7, [False] + [True] * 9])
    generated = torch.zeros(3, 10, dtype=torch.bool)
    generated[:, 6:] = True
    end = origin_columns("prompt_end", generated, valid)
    start = origin_columns("sequence_start", generated, valid)
    assert end.tolist() == [6, 6, 6] and start.tolist() == [0, 3, 1]
    assert origin_columns("sequence_start", generated).tolist() == [0, 0, 0]  # no padding: column 0
    # the block holding column 6: [4, 8) (2 prompt tokens), [3, 7) (3 prompt tokens), [5, 9) (1 prompt token)
    assert first_block_start(torch.full((3,), 6), start, 4).tolist() == [4, 3, 5]
    assert first_block_start(torch.full((3,), 6), end, 4).tolist() == [6, 6, 6]
    assert aligning_shifts(start, 4).tolist() == [0, 1, 3]  # invisible pads that put each origin on a multiple of 4


def test_the_declared_origin_is_read_and_checked() -> None:
    class Declares:
        block_origin = "sequence_start"

    class Wrong:
        block_origin = "middle"

    assert block_origin_of(Declares()) == "sequence_start" and block_origin_of(object()) == "prompt_end"
    with pytest.raises(ValueError, match="block_origin: Wrong declares 'middle'"):
        block_origin_of(Wrong())


def test_shift_left_undoes_shift_right_on_tokens_and_hidden_states() -> None:
    x = torch.arange(2 * 5).reshape(2, 5)
    h = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    shifts = torch.tensor([0, 3])
    moved = shift_right(x, shifts, 8, -1)
    assert moved.tolist() == [[0, 1, 2, 3, 4, -1, -1, -1], [-1, -1, -1, 5, 6, 7, 8, 9]]
    assert torch.equal(shift_left(moved, shifts, 5), x)
    assert torch.equal(shift_left(shift_right(h, shifts, 8, 0.0), shifts, 5), h)
    assert shift_left(x, torch.zeros(2, dtype=torch.long), 5) is x  # nothing moved: no copy

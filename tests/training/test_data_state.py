"""Resumable data: ArrayBatchIterator order/state, and data-state encoding."""

import numpy as np
import pytest

from adaflash_jax.training.state import ArrayBatchIterator, decode_data_state, encode_data_state


def _arrays(n=10, t=12):
    tokens = np.arange(n * t, dtype=np.int32).reshape(n, t)
    return tokens, np.full((n,), 2, np.int32), np.full((n,), t, np.int32)


def _rows(batches):
    return [tuple(b.tokens[:, 0] // 12) for b in batches]


def test_order_is_a_function_of_seed_and_epoch():
    a, b = ArrayBatchIterator(*_arrays(), 3, seed=1), ArrayBatchIterator(*_arrays(), 3, seed=1)
    first = _rows(next(a) for _ in range(9))
    assert first == _rows(next(b) for _ in range(9))
    epoch0, epoch1 = first[:3], first[3:6]  # 10 rows, batch 3 -> 3 batches per epoch
    assert epoch0 != epoch1 and len(set(sum(epoch0, ()))) == 9
    other = ArrayBatchIterator(*_arrays(), 3, seed=2)
    assert _rows(next(other) for _ in range(3)) != epoch0


def test_state_restores_the_position_across_epochs():
    it = ArrayBatchIterator(*_arrays(), 3, seed=0)
    for _ in range(4):
        next(it)
    state = it.get_state()
    assert (state["epoch"], state["position"]) == (1, 1)
    expected = _rows(next(it) for _ in range(5))
    fresh = ArrayBatchIterator(*_arrays(), 3, seed=0)
    fresh.set_state(decode_data_state(encode_data_state(state)))
    assert _rows(next(fresh) for _ in range(5)) == expected


def test_state_of_other_data_is_refused():
    state = ArrayBatchIterator(*_arrays(), 3, seed=0).get_state()
    with pytest.raises(ValueError, match="num_sequences=10.*has num_sequences=8"):
        ArrayBatchIterator(*_arrays(n=8), 3, seed=0).set_state(state)


def test_invalid_arrays_are_refused():
    tokens, p, s = _arrays()
    with pytest.raises(ValueError, match="batch_size 11"):
        ArrayBatchIterator(tokens, p, s, 11)
    with pytest.raises(ValueError, match="prompt_len \\+ 2 <= seq_len"):
        ArrayBatchIterator(tokens, p, np.full_like(s, 3), 2)


def test_bytes_and_json_states_round_trip():
    for state in (b"\x00grain\xff", {"epoch": 2, "position": [1, 2]}, None):
        assert decode_data_state(encode_data_state(state)) == state
    with pytest.raises(TypeError, match="bytes or a JSON-able value"):
        encode_data_state({"x": object()})

"""Arguments every public entry point checks alike (scaled_dot_product_attention,
MultiHeadAttention, Attention, the alignment registry, the positional
encodings): bool flags must be bools (not "False", 0 or None),
numpy.ma.MaskedArray inputs are refused (their mask would be silently
ignored), and ragged nested lists give an error that names the argument."""
import numpy as np
import pytest

import attncore
from attncore import scaled_dot_product_attention as sdpa

from reference import attention as ref
from reference import rand


# ---------------------------------------------------------------- bool flags
def _mha():
    return attncore.MultiHeadAttention(8, 2, rng=0)


X = rand((1, 3, 8))
Q3 = rand((1, 2, 3, 4), dtype=np.float64)

BOOL_FLAG_CASES = {
    "sdpa-enable_gqa": ("enable_gqa", lambda bad: sdpa(Q3, Q3, Q3, enable_gqa=bad)),
    "sdpa-return_weights": ("return_weights", lambda bad: sdpa(Q3, Q3, Q3, return_weights=bad)),
    "mha-need_weights": ("need_weights", lambda bad: _mha()(X, need_weights=bad)),
    "mha-average_attn_weights": ("average_attn_weights",
                                 lambda bad: _mha()(X, need_weights=True, average_attn_weights=bad)),
    "mha-bias": ("bias", lambda bad: attncore.MultiHeadAttention(8, 2, bias=bad)),
    "attention-return_weights": ("return_weights",
                                 lambda bad: attncore.Attention()(X, X, return_weights=bad)),
    "attention-step-return_weights": (
        "return_weights",
        lambda bad: attncore.Attention().step(X, attncore.Attention().prepare(X), return_weights=bad)),
    "register-replace": ("replace",
                         lambda bad: attncore.alignments.register("ac-bool-flag-test", attncore.Alignment,
                                                                  replace=bad)),
    "available-details": ("details", lambda bad: attncore.alignments.available(details=bad)),
}


@pytest.mark.parametrize("bad", ["False", "no", 0, 1, None, 1.0], ids=repr)
@pytest.mark.parametrize("case", sorted(BOOL_FLAG_CASES))
def test_bool_flags_reject_non_bools(case, bad):
    name, call = BOOL_FLAG_CASES[case]
    with pytest.raises(TypeError, match=rf"{name} must be a bool.*got {type(bad).__name__}"):
        call(bad)


def test_bool_flags_accept_numpy_bool():
    out, w = sdpa(Q3, Q3, Q3, enable_gqa=np.False_, return_weights=np.True_)
    np.testing.assert_allclose(out, ref(Q3, Q3, Q3)[0], rtol=1e-12, atol=1e-12)
    assert sdpa(Q3, Q3, Q3, return_weights=np.False_).shape == (1, 2, 3, 4)
    o, w = _mha()(X, need_weights=np.True_, average_attn_weights=np.False_)
    assert w.shape == (1, 2, 3, 3)


# ---------------------------------------------------------------- masked arrays
MASKED = np.ma.masked_array(Q3, mask=np.zeros(Q3.shape, bool))

MASKED_CASES = {
    "sdpa-query": ("query", "attn_mask", lambda: sdpa(MASKED, Q3, Q3)),
    "sdpa-key": ("key", "attn_mask", lambda: sdpa(Q3, MASKED, Q3)),
    "sdpa-value": ("value", "attn_mask", lambda: sdpa(Q3, Q3, MASKED)),
    "sdpa-attn_mask": ("attn_mask", None,
                       lambda: sdpa(Q3, Q3, Q3, np.ma.masked_array(np.ones((3, 3), bool)))),
    "mha-query": ("query", "key_mask", lambda: _mha()(np.ma.masked_array(X))),
    "mha-key": ("key", "key_mask", lambda: _mha()(X, np.ma.masked_array(X))),
    "mha-key_mask": ("key_mask", None,
                     lambda: _mha()(X, key_mask=np.ma.masked_array(np.ones((1, 3), bool)))),
    "attention-query": ("query", "mask", lambda: attncore.Attention()(np.ma.masked_array(X), X)),
    "attention-keys": ("keys", "mask", lambda: attncore.Attention()(X, np.ma.masked_array(X))),
    "attention-values": ("values", "mask",
                         lambda: attncore.Attention()(X, X, np.ma.masked_array(X))),
}


@pytest.mark.parametrize("case", sorted(MASKED_CASES))
def test_masked_arrays_rejected(case):
    name, mask_arg, call = MASKED_CASES[case]
    with pytest.raises(TypeError, match=f"{name} must not be a numpy.ma.MaskedArray") as exc:
        call()
    if mask_arg is not None:
        assert mask_arg in str(exc.value)


# ---------------------------------------------------------------- ragged lists
RAGGED = [[1.0, 2.0], [3.0]]

RAGGED_CASES = {
    "sdpa-query": ("query", lambda: sdpa(RAGGED, Q3, Q3)),
    "sdpa-key": ("key", lambda: sdpa(Q3, RAGGED, Q3)),
    "sdpa-value": ("value", lambda: sdpa(Q3, Q3, RAGGED)),
    "sdpa-attn_mask": ("attn_mask", lambda: sdpa(Q3, Q3, Q3, [[True], [True, False]])),
    "mha-query": ("query", lambda: _mha()(RAGGED)),
    "mha-key_mask": ("key_mask", lambda: _mha()(X, key_mask=[[True], [True, False]])),
    "mha-attn_mask": ("attn_mask", lambda: _mha()(X, attn_mask=[[True], [True, False]])),
    "attention-keys": ("keys", lambda: attncore.Attention()(X, RAGGED)),
    "attention-mask": ("mask", lambda: attncore.Attention()(X, X, mask=[[True], [True, False]])),
    "positional-x": ("x", lambda: attncore.add_positional_encoding(RAGGED)),
    "positional-positions": ("length_or_positions",
                             lambda: attncore.sinusoidal_encoding(RAGGED, 4)),
    "from_arrays-q_weight": ("q_weight", lambda: attncore.MultiHeadAttention.from_arrays(
        q_weight=RAGGED, k_weight=RAGGED, v_weight=RAGGED, out_weight=RAGGED, num_heads=1)),
}


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_lists_name_the_argument(case):
    name, call = RAGGED_CASES[case]
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        call()


# ---------------------------------------------------------- huge thread counts
HUGE_THREADS_CASES = {
    "sdpa": lambda x, nt: sdpa(x, x, x, num_threads=nt),
    "sdpa-int8": lambda x, nt: sdpa(x, x, x, precision="int8", num_threads=nt),
    "rotary": lambda x, nt: attncore.rotary_embedding(x, num_threads=nt),
    "mha": lambda x, nt: attncore.MultiHeadAttention(64, 2, rng=0)(
        x.reshape(2, 128, 64), num_threads=nt)[0],
}


@pytest.mark.parametrize("nt", [100_000, 2**31, 2**63])
@pytest.mark.parametrize("case", sorted(HUGE_THREADS_CASES))
def test_huge_thread_counts_run_at_most_max_threads(case, nt):
    """A thread count beyond attncore._threads.max_threads() runs that many
    threads (it crashed the process, or leaked an OverflowError, in the
    rotary, MultiHeadAttention and int8 paths): the result is the one of
    a single thread."""
    from attncore._threads import max_threads, resolve_num_threads

    assert resolve_num_threads(nt) == max_threads()
    x = rand((1, 4, 64, 64), seed=3)
    fn = HUGE_THREADS_CASES[case]
    np.testing.assert_allclose(fn(x, nt), fn(x, 1), rtol=1e-5, atol=1e-6)


# ------------------------------------------- errors that named nothing (NumPy's)
@pytest.mark.parametrize("bad, exc", [("abc", TypeError), (1.5, TypeError), (True, TypeError),
                                      ([[1]], TypeError), (-1, ValueError)])
def test_mha_rng_is_a_generator_or_seed(bad, exc):
    with pytest.raises(exc, match="rng"):
        attncore.MultiHeadAttention(8, 2, rng=bad)
    # a NumPy integer seed is a seed
    np.testing.assert_array_equal(attncore.MultiHeadAttention(8, 2, rng=np.int64(3)).q_weight,
                                  attncore.MultiHeadAttention(8, 2, rng=3).q_weight)


@pytest.mark.parametrize("bad", [None, 1.5, 0, "ab"])
def test_merge_attention_parts_must_be_sequences(bad):
    part = [np.zeros((2, 3))]
    with pytest.raises(TypeError, match="outputs must be a sequence"):
        attncore.merge_attention(bad, [np.zeros(2)])
    with pytest.raises(TypeError, match="lses must be a sequence"):
        attncore.merge_attention(part, bad)


def test_layer_positions_must_be_integers():
    m = attncore.MultiHeadAttention(16, 2, rotary=True, rng=0)
    x = rand((1, 2, 16))
    for bad in ("abc", [0.5, 1.5], [True, False]):
        with pytest.raises(TypeError, match="positions must be an integer array"):
            m(x, cache=m.new_cache(1, 8), positions=bad)

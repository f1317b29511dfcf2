"""attncore in transformers' continuous batching (``model.generate_batch``).

Offline, on tiny random models in float32: greedy tokens of attncore's
``"paged|eager"`` function (:func:`register`) against transformers' own
``"sdpa"`` and ``"paged|eager"`` continuous batching, per-sequence offsets
reaching :func:`attncore.varlen_attention`, sliding-window layers, attention
sinks, fallbacks and bad inputs.
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("attncore.integrations.transformers needs transformers >= 5",
                allow_module_level=True)

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

try:
    from transformers import ContinuousBatchingConfig
except ImportError:
    pytest.skip("this transformers has no continuous batching", allow_module_level=True)

import attncore.integrations.transformers as act  # noqa: E402

if not hasattr(LlamaForCausalLM, "generate_batch"):
    pytest.skip("this transformers has no continuous batching", allow_module_level=True)

PROMPT_LENGTHS = (3, 17, 40, 9, 64, 1)
NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def paged_restored():
    """Every test starts with attncore registered (continuous batching on)
    and leaves transformers' own "paged|eager" function in place."""
    act.register()
    yield
    act.register(continuous_batching=False)


def _gen_config():
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)


def _prompts(lengths=PROMPT_LENGTHS, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _generate_batch(model, impl, prompts, max_batch_tokens=512):
    """Greedy tokens per prompt of continuous batching with ``impl``:
    "attncore" (attncore's "paged|eager"), "paged|eager" (transformers'
    own) or "sdpa".  A small cache (transformers' default sizes it from the
    free memory: seconds of page faults per call); ``max_batch_tokens``
    below the prompts' total length splits prefill into chunks."""
    if impl == "attncore":
        act.register()
        model.set_attn_implementation("paged|eager")
    else:
        act.register(continuous_batching=False)
        model.set_attn_implementation(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate_batch(
            prompts, generation_config=_gen_config(),
            continuous_batching_config=ContinuousBatchingConfig(
                num_blocks=64, max_batch_tokens=max_batch_tokens))
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


@pytest.fixture
def varlen_spy(monkeypatch):
    """The calls of attncore.varlen_attention made by the integration:
    (cu_seqlens_q, cu_seqlens_k, total_q, total_k, keywords)."""
    calls = []
    real = act.varlen_attention

    def spy(q, k, v, cu_q, cu_k, **kw):
        calls.append((np.asarray(cu_q).copy(), np.asarray(cu_k).copy(), q.shape[0],
                      k.shape[0], kw))
        return real(q, k, v, cu_q, cu_k, **kw)

    monkeypatch.setattr(act, "varlen_attention", spy)
    return calls


@pytest.mark.parametrize("max_batch_tokens", [512, 24])
def test_tokens_identical_to_sdpa_and_paged_eager(varlen_spy, max_batch_tokens):
    # 24: prompts longer than a step prefilled in chunks (queries after cached keys)
    model, prompts = _llama(), _prompts()
    ours = _generate_batch(model, "attncore", prompts, max_batch_tokens)
    assert varlen_spy, "attncore's varlen attention was not called"
    assert all(len(t) == NEW_TOKENS for t in ours)
    assert max(c[2] for c in varlen_spy) <= max_batch_tokens
    assert ours == _generate_batch(model, "sdpa", prompts, max_batch_tokens)
    assert ours == _generate_batch(model, "paged|eager", prompts, max_batch_tokens)


def test_varlen_receives_per_sequence_offsets(varlen_spy):
    model, prompts = _llama(), _prompts()
    _generate_batch(model, "attncore", prompts)
    n_layers = model.config.num_hidden_layers
    assert len(varlen_spy) % n_layers == 0
    for cu_q, cu_k, total_q, total_k, kw in varlen_spy:
        # offsets of sequences, not one packed row with a (total_q x total_k) mask
        assert cu_q[0] == 0 and cu_q[-1] == total_q and cu_k[-1] == total_k
        assert np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= np.diff(cu_q))
        assert kw["is_causal"] is True and kw["enable_gqa"] is True
    # several sequences in one call, and the prompts' lengths appear as the
    # sequences' query counts (prefill) with as many keys
    assert max(len(c[0]) - 1 for c in varlen_spy) > 1
    seen_q = set()
    for cu_q, *_ in varlen_spy:
        seen_q.update(np.diff(cu_q).tolist())
    assert set(PROMPT_LENGTHS) <= seen_q
    # decoding steps: one query per sequence over all its keys
    decode = [c for c in varlen_spy if np.all(np.diff(c[0]) == 1)]
    assert decode and any(np.diff(c[1]).max() >= max(PROMPT_LENGTHS) for c in decode)


def _generate_or_error(model, ids):
    try:
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    except Exception as exc:        # transformers 5.23's "paged|eager" refuses this
        return type(exc), str(exc)


def test_ordinary_generate_with_paged_eager_is_transformers(varlen_spy):
    model = _llama()
    ids = torch.tensor([_prompts((12,))[0]])
    act.register(continuous_batching=False)
    model.set_attn_implementation("paged|eager")
    ref = _generate_or_error(model, ids)
    act.register()
    out = _generate_or_error(model, ids)
    assert not varlen_spy
    if isinstance(ref, tuple):
        assert out == ref
    else:
        assert torch.equal(ref, out)


def test_sliding_window_layers(varlen_spy):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, use_sliding_window=True, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
    model, prompts = Qwen2ForCausalLM(cfg).eval(), _prompts()
    ours = _generate_batch(model, "attncore", prompts)
    assert {c[4]["window"] for c in varlen_spy} == {(7, 0), None}
    assert ours == _generate_batch(model, "sdpa", prompts)


def test_attention_sinks(varlen_spy, monkeypatch):
    try:
        from transformers import GptOssConfig, GptOssForCausalLM
    except ImportError:
        pytest.skip("this transformers has no gpt-oss")
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=512, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    sdpa_calls = []
    real = act.scaled_dot_product_attention

    def spy(*args, **kw):
        sdpa_calls.append(kw["sinks"])
        return real(*args, **kw)

    monkeypatch.setattr(act, "scaled_dot_product_attention", spy)
    prompts = _prompts((3, 17, 30))
    ours = _generate_batch(model, "attncore", prompts)
    # sinks: attncore's scaled_dot_product_attention sequence by sequence
    assert not varlen_spy and sdpa_calls and all(s is not None for s in sdpa_calls)
    assert ours == _generate_batch(model, "paged|eager", prompts)


def test_register_continuous_batching_switch():
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward

    assert AttentionInterface().get("paged|eager") is act.paged_attention_forward
    act.register()                      # again: no change, the original kept
    act.register(continuous_batching=False)
    assert AttentionInterface().get("paged|eager") is eager_paged_attention_forward
    with pytest.raises(TypeError, match="continuous_batching"):
        act.register(continuous_batching="yes")


class _Layer(torch.nn.Module):
    is_causal = True
    training = False


def _packed(lens_q, lens_k, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, sum(lens_q), D, generator=g)
    k = torch.randn(1, Hkv, sum(lens_k), D, generator=g)
    v = torch.randn(1, Hkv, sum(lens_k), D, generator=g)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)
          for n in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


def test_paged_forward_against_per_sequence_sdpa():
    lens_q, lens_k = (5, 1, 0, 3), (5, 9, 4, 12)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    mask = torch.zeros(1, 1, q.shape[2], k.shape[2])    # ignored
    out, w = act.paged_attention_forward(_Layer(), q, k, v, mask, scaling=0.3,
                                         cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    assert w is None and out.shape == (1, q.shape[2], 4, 8) and out.is_contiguous()
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        Lq, Lk = int(q1 - q0), int(k1 - k0)
        causal = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1].repeat_interleave(2, 1),
            v[:, :, k0:k1].repeat_interleave(2, 1), attn_mask=causal, scale=0.3)
        torch.testing.assert_close(out[0, q0:q1], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_paged_forward_padded_positions():
    # static shapes pad the packed row past the last offset: those rows come out 0
    q, k, v, cu_q, cu_k = _packed((2, 3, 2), (4, 5, 3))
    out, _ = act.paged_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu_q[:3],
                                         cu_seq_lens_k=cu_k[:3])
    full, _ = act.paged_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu_q,
                                          cu_seq_lens_k=cu_k)
    assert out.shape == full.shape
    torch.testing.assert_close(out[0, :5], full[0, :5])
    assert not out[0, 5:].any()


def test_paged_forward_bad_offsets():
    q, k, v, cu_q, cu_k = _packed((2, 3), (4, 5))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        act.paged_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu_q[:2] + 7,
                                    cu_seq_lens_k=cu_k[:2])
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
        act.paged_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu_q,
                                    cu_seq_lens_k=cu_k[:2])
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        act.paged_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu_q,
                                    cu_seq_lens_k=cu_k.float())
    with pytest.raises(ValueError, match="dropout"):
        act.paged_attention_forward(_Layer(), q, k, v, None, dropout=0.1, cu_seq_lens_q=cu_q,
                                    cu_seq_lens_k=cu_k)


def test_paged_forward_falls_back_for_non_causal_layers(monkeypatch):
    seen = []

    def transformers_own(module, query, key, value, attention_mask, **kwargs):
        seen.append(sorted(kwargs))
        return "theirs", None

    monkeypatch.setattr(act, "_paged_original", lambda: transformers_own)
    layer = _Layer()
    layer.is_causal = False
    q, k, v, cu_q, cu_k = _packed((2, 3), (2, 3))
    with pytest.warns(RuntimeWarning, match="not causal"):
        out, _ = act.paged_attention_forward(layer, q, k, v, None, scaling=0.5,
                                             cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    assert out == "theirs"
    assert seen == [["cu_seq_lens_k", "cu_seq_lens_q", "dropout", "scaling"]]
    # not a continuous-batching call (no offsets): transformers' function, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = act.paged_attention_forward(_Layer(), q, k, v, None, scaling=0.5)
    assert out == "theirs"


# each reason of _paged_unsupported: (how a step gets it, words of the reason,
# how docs/guide/pytorch.rst and paged_attention_forward's docstring name it)
_FALLBACKS = [
    ("block_table", "block table", "a block table instead of the gathered keys / values"),
    ("meta", "tensors are on meta", "tensors off the CPU"),
    ("3-D", "not packed into one row", "queries / keys / values not packed into one row"),
    ("non-causal", "not causal", "non-causal layers"),
    ("position_bias", "position_bias", "``position_bias``"),
    ("output_attentions", "attention weights", "attention weights asked for"),
    ("int32", "dtype torch.int32 is not supported",
     "a dtype other than float32, float64, float16 and bfloat16"),
]


def _fallback_step(how):
    """A continuous-batching step's arguments that take the fallback ``how``."""
    q, k, v, cu_q, cu_k = _packed((2, 3), (2, 3))
    layer, kw = _Layer(), dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    if how == "block_table":
        kw["block_table"] = torch.zeros(2, 1, dtype=torch.int32)
    elif how == "meta":
        q, k, v = (t.to("meta") for t in (q, k, v))
    elif how == "3-D":
        q, k, v = q[0], k[0], v[0]
    elif how == "non-causal":
        layer.is_causal = False
    elif how in ("position_bias", "output_attentions"):
        kw[how] = torch.zeros(1) if how == "position_bias" else True
    else:
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
    return layer, q, k, v, kw


def test_every_fallback_reason_is_documented():
    """Each reason the continuous-batching function falls back for (every
    non-empty answer of _paged_unsupported) is reached by a step, and
    named in pytorch.rst's list and in paged_attention_forward's docstring
    (the list left out the block table and the dtype)."""
    import inspect
    import pathlib
    import re
    src = inspect.getsource(act._paged_unsupported)
    reasons = re.findall(r'return f?"([^"]+)"', src)
    assert len(reasons) == len(_FALLBACKS), reasons      # a new reason: list it here
    rst = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "pytorch.rst"
    if not rst.exists():
        pytest.skip("the docs are not here (an installed package's tests)")
    docs = " ".join(rst.read_text().split())
    doc = " ".join(act.paged_attention_forward.__doc__.split())
    for how, words, named in _FALLBACKS:
        layer, q, k, v, kw = _fallback_step(how)
        assert words in act._paged_unsupported(layer, q, k, v, kw)
        assert named in docs, named
        assert named in doc, named

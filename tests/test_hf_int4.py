"""attncore.integrations.transformers.Int4Cache: the 4-bit key/value cache
of transformers' generate, read by attncore's attention function.

References: a float64 attention written here over the keys / values the
cache stores, decoded by the documented 4-bit format (test_kvcache4's
decoder) for the tokens before the float window; and, for whole models,
the same tiny random Llama with its default float cache (greedy tokens
agree while the prompt fits in the window: every key then is in float).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("attncore.integrations.transformers needs transformers >= 5",
                allow_module_level=True)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import attncore.integrations.transformers as act  # noqa: E402
from attncore.integrations._hf_int4 import _Int4Layer  # noqa: E402
from test_kvcache4 import _decode4  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    act.register()


def _config():
    return LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("window", [0, 5, 64])
def test_attention_over_the_layer_matches_the_documented_cache(window):
    g = torch.Generator().manual_seed(0)
    B, H, Hk, D = 2, 4, 2, 32
    layer = _Int4Layer(window, 16, True)
    ks, vs = [], []
    for T in (17, 1, 1, 6, 1):
        k = torch.randn(B, Hk, T, D, generator=g)
        v = torch.randn(B, Hk, T, D, generator=g)
        q = torch.randn(B, H, T, D, generator=g)
        n_old = layer.get_seq_length()
        f0 = max(0, n_old - window)
        kp, vp = layer.update(k, v)
        ks.append(k)
        vs.append(v)
        out, w = act.attention_forward(_Module(), q, kp, vp, None, scaling=0.3)
        assert w is None and out.shape == (B, T, H, D)
        n = n_old + T
        kf = torch.cat(ks, 2).double().numpy()
        vf = torch.cat(vs, 2).double().numpy()
        if f0:
            kf[:, :, :f0] = _decode4(layer._store, 0, f0)
            vf[:, :, :f0] = _decode4(layer._store, 1, f0)
        kf, vf = np.repeat(kf, H // Hk, 1), np.repeat(vf, H // Hk, 1)
        s = 0.3 * q.double().numpy() @ kf.transpose(0, 1, 3, 2)
        s[..., np.arange(n)[None, :] > (n_old + np.arange(T))[:, None]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = ((p / p.sum(-1, keepdims=True)) @ vf).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_generate_agrees_with_the_float_cache_inside_the_window():
    torch.manual_seed(0)
    m = LlamaForCausalLM._from_config(_config(), attn_implementation="attncore").eval()
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = m.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        c = act.Int4Cache(m.config, window=64)
        got = m.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10, cache=c)
    # (every key in the float window: the same tokens)
    assert torch.equal(ref, got)
    assert c.get_seq_length() == 29
    # beyond the window, a shorter window: it runs, with the 4-bit keys
    with torch.inference_mode():
        c = act.Int4Cache(m.config, window=4)
        out = m.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                         cache=c, num_beams=2)
    assert out.shape == (2, 30)


def test_other_attention_refuses_the_placeholders():
    torch.manual_seed(0)
    m = LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa").eval()
    ids = torch.randint(3, 97, (1, 8))
    with torch.inference_mode(), pytest.raises(TypeError, match="attn_implementation='attncore'"):
        m.generate(ids, max_new_tokens=2, do_sample=False, cache=act.Int4Cache(m.config))

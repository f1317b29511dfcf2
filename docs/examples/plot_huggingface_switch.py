"""
Hugging Face transformers on attncore's kernels
===============================================

:func:`attncore.integrations.transformers.register` adds attncore to
transformers' attention backends under the name ``"attncore"``; a model
then runs its attention on attncore with ``attn_implementation="attncore"``
in ``from_pretrained`` / ``from_config``, or switches a loaded model with
``model.set_attn_implementation("attncore")``.  Everything else of the model
stays in torch.

A small Llama-style model with random weights (grouped-query attention: 8
query heads, 2 key/value heads) is built from a config here, so nothing is
downloaded; a pretrained checkpoint works the same way.
"""
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import attncore.integrations.transformers as act

hf_logging.set_verbosity_error()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=512)
model = LlamaForCausalLM(config).eval()
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
      f"attention: {model.config._attn_implementation}")

# %%
# Register and switch
# -------------------
name = act.register()              # once per process
print("registered as", repr(name))

# a batch of two prompts, the second left-padded (attention_mask 0 = padding)
ids = torch.randint(0, config.vocab_size, (2, 48))
mask = torch.ones_like(ids)
mask[1, :12] = 0


def logits(impl):
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).logits


ref = logits("sdpa")
ours = logits("attncore")
real = mask.bool()
print(f"logits, attncore vs sdpa: max |difference| {(ours - ref)[real].abs().max():.1e} "
      f"(largest logit {ref[real].abs().max():.1f})")

# %%
# Generation
# ----------
# Decoding goes through transformers' KV cache; attncore reads the cached
# keys and values in place and uses its lower-right causal alignment for the
# new tokens.  Greedy decoding gives the same tokens with either backend:
gen = {}
for impl in ("sdpa", "attncore"):
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       pad_token_id=0)                           # warm up
        t0 = time.perf_counter()
        gen[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=16,
                                   do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    print(f"{impl:>8}: 16 new tokens in {1e3 * dt:.0f} ms, "
          f"first ones {gen[impl][0, 48:56].tolist()}")
print("same tokens:", bool(torch.equal(gen["sdpa"], gen["attncore"])))

# %%
# Attention weights
# -----------------
# ``output_attentions=True`` returns the weights (as the ``eager`` backend
# does; ``sdpa`` cannot).  The left-padded prompt's weights on its padding
# are 0:
model.set_attn_implementation("attncore")
with torch.inference_mode():
    att = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
print(len(att), "layers of", tuple(att[0].shape), "weights; on padding:",
      float(att[0][1, :, 12:, :12].sum()))
np.testing.assert_allclose(att[0][0].sum(-1).numpy(), 1.0, rtol=1e-5)

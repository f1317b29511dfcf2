"""attncore as an attention backend of Hugging Face transformers (>= 5).

::

    import attncore.integrations.transformers as act
    act.register()                          # once per process; name "attncore"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attncore")
    model.set_attn_implementation("attncore")           # or switch a loaded model

:func:`register` puts two functions under one name:

* :func:`attention_forward` in transformers' ``AttentionInterface``: query
  (B, H, L, D) and key / value (B, Hkv, S, D) (already joined with the KV
  cache) are read as NumPy views without copies and handed to
  :func:`attncore.scaled_dot_product_attention` with ``enable_gqa=True``
  (grouped-query heads are never repeated); the output comes back as a
  torch tensor in the (B, L, H, D) layout transformers expects;
* :func:`attention_mask` in ``AttentionMaskInterface``: transformers' own
  boolean mask (True = attend, attncore's convention too), except that no
  mask is built at all for plain causal attention without padding -- also
  with a KV cache, where attncore's lower-right causal alignment covers
  chunks of several new tokens that PyTorch's ``is_causal`` cannot.

Continuous batching (``model.generate_batch(...)``,
``model.init_continuous_batching()``): transformers 5 runs it only with
the implementation names ``"sdpa"``, ``"paged|eager"`` or a flash-attention
name (a fixed list checked before the first step; a name such as
``"attncore"`` or ``"paged|attncore"`` is refused), and builds a
block-diagonal (total queries x total keys) mask for the first two.  So
:func:`register` also puts :func:`paged_attention_forward` under
transformers' own ``"paged|eager"`` key (process-wide; ``register(...,
continuous_batching=False)`` puts transformers' function back)::

    act.register()
    model.set_attn_implementation("paged|eager")  # or load with "eager": CB switches it
    out = model.generate_batch(prompts, generation_config=cfg)

Each continuous-batching step then reaches attncore as the packed queries
of all scheduled sequences with their ``cu_seq_lens_q`` /
``cu_seq_lens_k`` offsets, over the keys / values transformers' paged
cache gathered for them, and runs :func:`attncore.varlen_attention`:
each sequence attends only its own keys (the mask is not read), causal
and sliding-window bands aligned per sequence, grouped-query heads read in
place.  Calls that are not continuous-batching steps (no ``cu_seq_lens_*``)
and what the varlen kernel does not cover go to transformers' own
``"paged|eager"`` function unchanged (see :func:`paged_attention_forward`).

Inference only: dropout > 0 and training with gradients are errors.
attncore runs on the CPU: models on another device are rejected with a
``TypeError`` naming the device.  The thread count is torch's
(``torch.get_num_threads()``), so ``torch.set_num_threads`` governs both;
calls of fewer than :data:`TEAM_FLOPS` flops run on the calling thread
(torch's workers spin on the other cores between its operations).
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

from .._dtypes import parse_precision
from .._interop import numpy_to_torch, torch_bits_tensor, torch_bits_view, torch_to_numpy
from .._kvcache4 import KVCache4
from .._threads import resolve_num_threads
from .._validation import parse_softcap
from .._varlen import varlen_attention
from .._lean import attention_prepared
from ..functional import scaled_dot_product_attention

__all__ = ["register", "attention_forward", "attention_mask", "paged_attention_forward",
           "Int4Cache"]  # noqa: F822 (module __getattr__, lazily)


def __getattr__(name: str):
    # the 4-bit cache imports transformers' cache classes: only when asked for
    if name == "Int4Cache":
        from ._hf_int4 import Int4Cache

        return Int4Cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Threads of an attention call inside a torch model: torch's own OpenMP
# workers spin on the other cores between torch's operations (libgomp's
# default wait policy), so a second attncore thread there first has to take
# a core from a spinning worker, and its idle poll after the call takes
# time from torch's next operation.  Calls below this many flops (4 B H L S
# D) run on the calling thread.  Measured (whole generate, SmolLM2-135M
# float32, 512-token prompt + 32 new, 2 threads, quiet Xeon family 6 model
# 207, medians of 9 in rotated order, two runs): "sdpa" / attncore 0.93 -
# 0.96 with torch's thread count on every call, 0.98 - 1.04 with every
# call on the calling thread (the prompt's calls: 6e8 flops each), 1.05
# with torch's count for the prompt's calls only.
TEAM_FLOPS = 2e9


def _threads(torch, B, H, L, S, D) -> int:
    """Threads of an attention call of these sizes inside a torch model:
    torch's count (``torch.get_num_threads()``) for calls of at least
    :data:`TEAM_FLOPS`, else 1."""
    n = resolve_num_threads(torch.get_num_threads())
    return n if 4.0 * B * H * L * S * D >= TEAM_FLOPS else 1


# names transformers treats specially (their own checks / kernels)
_RESERVED = ("sdpa", "flex_attention", "flash", "paged", "eager")

# the key of transformers' continuous-batching attention on the CPU (one of
# the three kinds of names its continuous batching accepts), and the
# function registered there before attncore's (transformers' own)
PAGED_NAME = "paged|eager"
_paged_previous = None


def register(name: str = "attncore", precision: str | None = None, *,
             continuous_batching: bool = True) -> str:
    """Register attncore with transformers under ``name``.

    After this, ``attn_implementation=name`` works in ``from_pretrained``,
    ``from_config`` and ``model.set_attn_implementation(name)``.  Calling it
    again is harmless; it sets the precision of that name's calls (again
    with no ``precision``: the default).

    Parameters
    ----------
    name : str, default "attncore"
        The implementation name.  Names containing ``"sdpa"``,
        ``"flash"``, ``"flex_attention"``, ``"paged"`` or ``"eager"`` are
        refused: transformers attaches its own behaviour to them.
    precision : {None, 'float32', 'bfloat16', 'int8'}, optional
        The dot products' precision of every attention call of models using
        ``name`` (``precision=`` of
        :func:`attncore.scaled_dot_product_attention`): ``"int8"`` runs
        Q.K^T on int8 rows, ``"bfloat16"`` bf16 products in a float32
        model.  ``None`` (the default): the tensors' own.  Not applied to
        continuous batching (its varlen calls run at the tensors' precision).
    continuous_batching : bool, default True
        Also register :func:`paged_attention_forward` under
        transformers' ``"paged|eager"`` key, the name of its continuous
        batching on the CPU: ``model.generate_batch`` /
        ``model.init_continuous_batching`` with
        ``attn_implementation="paged|eager"`` (or ``"eager"``, which
        continuous batching switches to it) then run each step's attention
        with :func:`attncore.varlen_attention`, sequence by sequence.
        transformers accepts no other name for this (``"attncore"`` and
        ``"paged|attncore"`` are refused by continuous batching).  This is
        process-wide; calls that are not continuous-batching steps still
        run transformers' function.  ``False`` puts transformers' own
        function back (if attncore's was there).

    Returns
    -------
    str
        ``name``.

    Raises
    ------
    ImportError
        transformers (>= 5) or torch is not installed.
    TypeError
        ``name`` not a non-empty str, ``continuous_batching`` not a bool.
    ValueError
        ``name`` containing a reserved word, an unknown ``precision``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(continuous_batching, (bool, np.bool_)):
        raise TypeError(f"continuous_batching must be a bool, got {continuous_batching!r}")
    prec = parse_precision(precision)
    low = name.lower()
    for r in _RESERVED:
        if r in low:
            raise ValueError(
                f"name must not contain {r!r} (transformers treats such names specially), "
                f"got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "attncore.integrations.transformers needs transformers >= 5 and torch; install them "
            "with `pip install 'attncore[transformers]'`") from exc
    if prec is None:
        AttentionInterface.register(name, attention_forward)
    else:
        def with_precision(module, query, key, value, attention_mask, **kwargs):
            return attention_forward(module, query, key, value, attention_mask,
                                     attncore_precision=prec, **kwargs)
        with_precision.__doc__ = attention_forward.__doc__
        AttentionInterface.register(name, with_precision)
    AttentionMaskInterface.register(name, attention_mask)
    _register_paged(AttentionInterface, bool(continuous_batching))
    return name


def _register_paged(interface, on: bool) -> None:
    """attncore's :func:`paged_attention_forward` under ``"paged|eager"``
    (``on``), or the function that was there before it back."""
    global _paged_previous
    current = interface().get(PAGED_NAME)
    if on:
        if current is not paged_attention_forward:
            if _paged_previous is None:     # the first one seen: transformers' own
                _paged_previous = current
            interface.register(PAGED_NAME, paged_attention_forward)
    elif current is paged_attention_forward:
        interface.register(PAGED_NAME, _paged_original())


# --------------------------------------------------------------------------
# the mask function
# --------------------------------------------------------------------------
def _plain_causal(kw) -> bool:
    """Whether the mask asked for is exactly lower-right causal over the keys
    given: no padding, the queries are the newest positions of the keys,
    and no sliding window / chunk boundary within reach.

    ``kw`` are the mask function's keywords: transformers passes
    ``q_length`` / ``q_offset`` (earlier 5.x releases: ``cache_position``),
    ``kv_length``, ``kv_offset``, ``attention_mask`` (2-D padding, True =
    token), ``local_size``.
    """
    torch = sys.modules["torch"]
    if torch.compiler.is_compiling():
        return False
    kv_length, kv_offset = kw.get("kv_length"), kw.get("kv_offset", 0)
    if "q_length" in kw:
        q_length, q_offset = kw["q_length"], kw.get("q_offset", 0)
    elif isinstance(kw.get("cache_position"), torch.Tensor):
        pos = kw["cache_position"]
        q_length = pos.shape[0]
        q_offset = int(pos[0]) if q_length else 0
    else:
        return False
    # static caches pass tensors here (and keys past the tokens seen): keep their masks
    if not all(isinstance(x, int) for x in (q_length, q_offset, kv_length, kv_offset)):
        return False
    if q_offset != kv_offset + kv_length - q_length:
        return False
    local_size = kw.get("local_size")
    if local_size is not None and (kv_offset != 0 or kv_length >= local_size):
        return False
    pad = kw.get("attention_mask")
    if pad is not None:
        if pad.ndim != 2 or pad.shape[-1] < kv_offset + kv_length:
            return False
        if not bool(pad[:, kv_offset:kv_offset + kv_length].all()):
            return False
    return True


def attention_mask(*args, **kwargs):
    """Mask function for transformers' ``AttentionMaskInterface``.

    Returns ``None`` (no mask: :func:`attention_forward` applies causal
    attention with attncore's lower-right alignment) when the mask would be
    plain causal over the given keys -- no padding, the queries being the
    newest positions (prefill, decoding and chunked prefill with a dynamic
    cache), no sliding window or chunk boundary within reach -- and
    otherwise what the ``"sdpa"`` backend's mask function returns with its
    causal skip turned off: a boolean (B, 1, L, S) mask, True = attend
    (``None`` for bidirectional attention without padding).
    """
    from transformers.masking_utils import sdpa_mask

    if not args and kwargs.get("allow_is_causal_skip", True) and _plain_causal(kwargs):
        return None
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


# --------------------------------------------------------------------------
# the attention function
# --------------------------------------------------------------------------
# what a tensor on another device is told (attncore._interop converts)
_MOVE_MODEL = "move the model there (model.to('cpu')) or use another attn_implementation"

# ---- sliding windows (transformers' convention) ----------------------------
# The ``sliding_window`` keyword a model passes to the attention function is
# the one transformers' flash-attention path turns into the band
# ``(sliding_window - 1, sliding_window - 1)``, the queries aligned to the last
# keys, the causal flag then cutting the right side: a causal layer sees the
# ``sliding_window`` keys ending at the query (``sliding_window_overlay``:
# kpos > qpos - sliding_window), a bidirectional one the keys within
# ``sliding_window - 1`` of it on either side
# (``sliding_window_bidirectional_overlay``: |qpos - kpos| <= w for
# ModernBERT's ``config.sliding_window`` w, which passes w + 1 here).
def _sliding_window(module, is_causal, kwargs, L, S):
    """(causal, kernel window or None, bool mask or None) of a call without
    mask: causal for L > 1 per ``is_causal`` (None: ``module.is_causal``),
    and the keyword ``sliding_window``."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal, window = bool(is_causal) and L > 1, kwargs.get("sliding_window")
    if window is None or S <= window:       # every key within reach
        return causal, None, None
    w = int(window)
    if causal or L == 1:                    # one query: the last position, either way
        return True, (w - 1, 0), None
    if L == S:                              # aligned: the kernel's band, both sides
        return False, (w - 1, w - 1), None
    qpos = np.arange(S - L, S)[:, None]     # queries are the last L positions
    kpos = np.arange(S)[None, :]
    return False, None, np.abs(kpos - qpos) <= w - 1
# ---- end of sliding windows -------------------------------------------------


def _check_inference(module, query, key, value, dropout) -> None:
    """Dropout and training refused; tensors that require gradients: a
    warning (the output is detached)."""
    torch = sys.modules["torch"]
    if dropout:
        raise ValueError(
            f"dropout={dropout!r}: attncore is inference only; call model.eval() (dropout is "
            f"then 0)")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        if getattr(module, "training", False):
            raise NotImplementedError(
                "attncore computes no gradients: training needs another attn_implementation "
                "(e.g. 'sdpa'); for inference call model.eval() and run under torch.no_grad() "
                "or torch.inference_mode()")
        warnings.warn(
            "attncore computes no gradients: the attention output is detached; run inference "
            "under torch.no_grad() or torch.inference_mode()", stacklevel=3)


def _lean(module, query, key, value, is_causal, scaling, kwargs):
    """The lean path of most calls (decoding steps, unpadded prefill) for a
    call without mask, weights, bias, sinks or precision: views, the
    kernel, and the output back as a torch tensor; None where it does not
    apply (then the general path runs).  As few torch operations as it can:
    between a model's layers the caches are cold, and each distinct one
    then costs microseconds (the dtype alone is checked here: ``numpy()``
    refuses tensors of another device or layout, and the NumPy dtypes are
    compared)."""
    torch = sys.modules["torch"]
    dt = query.dtype
    bits = dt is torch.bfloat16  # read as int16 bits (no ml_dtypes views on either side)
    if bits:
        if key.dtype is not dt or value.dtype is not dt:
            return None
    elif dt is not torch.float32 and dt is not torch.float16:
        return None
    try:
        q, k = torch_bits_view(query, bits), torch_bits_view(key, bits)
        v = torch_bits_view(value, bits)
    except (TypeError, RuntimeError, NotImplementedError):  # not a CPU strided tensor:
        return None  # the general path says why
    causal, win, mask = _sliding_window(module, is_causal, kwargs, q.shape[2], k.shape[2])
    if mask is not None:
        return None
    out = attention_prepared(q, k, v, 2 if causal else 0, scaling,
                             _threads(torch, *q.shape[:3], k.shape[2], q.shape[3]),
                             win or (-1, -1),
                             parse_softcap(kwargs.get("softcap")), bits)
    if out is None:
        return None
    B, H, L, Dv = out.shape
    if L == 1:  # (B, H, 1, Dv) is (B, 1, H, Dv) in memory (NumPy's reshape: the cheaper op)
        out = out.reshape(B, 1, H, Dv)
    t = torch_bits_tensor(out, bits)  # a fresh, writable array
    return t if L == 1 else t.transpose(1, 2).contiguous()


def _mask(module, attention_mask, is_causal, L, S, kwargs):
    """(causal, kernel window or None, mask or None) of the general path:
    the mask given (cut to the S keys) or causal / the sliding window, and
    ``position_bias`` added."""
    causal, win, mask = False, None, None
    if attention_mask is not None:
        m = attention_mask
        if m.shape[-1] > S:  # a mask sized for a longer (static) cache
            m = m[..., :S]
        mask = torch_to_numpy(m, "attention_mask", remedy=_MOVE_MODEL)[0]
    else:   # the kernel's band where it can (out-of-band key tiles skipped)
        causal, win, mask = _sliding_window(module, is_causal, kwargs, L, S)
    bias = kwargs.get("position_bias")
    if bias is not None:
        b = torch_to_numpy(bias, "position_bias", remedy=_MOVE_MODEL)[0]
        if mask is None:
            mask = b
        elif mask.dtype == np.bool_:
            mask = np.where(mask, b, b.dtype.type(-np.inf))
        else:
            mask = mask + b
    return causal, win, mask


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """Attention function for transformers' ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (its ``is_causal`` and ``training``
        are read).
    query : torch.Tensor, (B, H, L, D)
    key, value : torch.Tensor, (B, Hkv, S, D)
        Hkv divides H (grouped-query heads read in place).
    attention_mask : torch.Tensor or None
        Bool (True = attend) or float (added to the scores), broadcastable
        to (B, H, L, S).  ``None``: causal (lower-right aligned: the
        queries are the last L of the S positions) when ``is_causal``
        (else ``module.is_causal``) and L > 1, otherwise no mask.
    dropout : float
        Must be 0 (inference only).
    scaling : float, optional
        Default ``D ** -0.5``.
    is_causal : bool, optional
    **kwargs
        ``sliding_window`` (when no mask is given: the kernel's window --
        ``sliding_window`` keys ending at the query when causal, the keys
        within ``sliding_window - 1`` on either side when not, as
        transformers' flash-attention path and mask functions have it),
        ``softcap`` (logit soft-capping, fused in the kernel),
        ``position_bias`` (added to the scores), ``output_attentions``
        (return the weights; also taken from ``module.config``),
        ``s_aux`` (gpt-oss' attention sinks, one logit per head: their exp
        joins each row's softmax denominator, in the kernel),
        ``attncore_precision`` (``precision=`` of the kernel call; what
        :func:`register` sets).

    Returns
    -------
    attn_output : torch.Tensor, (B, L, H, D), contiguous
    attn_weights : torch.Tensor (B, H, L, S) or None
    """
    _check_inference(module, query, key, value, dropout)
    if getattr(key, "_attncore_parts", None) is not None:   # an Int4Cache layer's
        return _attention_int4(module, query, key._attncore_parts, attention_mask, scaling,
                               is_causal, kwargs), None
    need_weights = kwargs.get("output_attentions")
    if need_weights is None:
        need_weights = getattr(getattr(module, "config", None), "output_attentions", False)
    s_aux = kwargs.get("s_aux")
    precision = kwargs.get("attncore_precision")
    if (attention_mask is None and not need_weights and kwargs.get("position_bias") is None
            and s_aux is None and precision is None):
        out = _lean(module, query, key, value, is_causal, scaling, kwargs)
        if out is not None:
            return out, None
    q = torch_to_numpy(query, "query", remedy=_MOVE_MODEL)[0]
    k = torch_to_numpy(key, "key", remedy=_MOVE_MODEL)[0]
    v = torch_to_numpy(value, "value", remedy=_MOVE_MODEL)[0]
    causal, win, mask = _mask(module, attention_mask, is_causal, q.shape[2], k.shape[2], kwargs)
    torch = sys.modules["torch"]
    res = scaled_dot_product_attention(
        q, k, v, mask, is_causal="lower_right" if causal else False, scale=scaling,
        enable_gqa=True, return_weights=bool(need_weights), window=win,
        softcap=kwargs.get("softcap"),
        num_threads=_threads(torch, *q.shape[:3], k.shape[2], q.shape[3]),
        sinks=None if s_aux is None else torch_to_numpy(s_aux, "s_aux", remedy=_MOVE_MODEL)[0],
        precision=precision)
    out, w = res if need_weights else (res, None)
    return (numpy_to_torch(out, query.dtype).transpose(1, 2).contiguous(),
            None if w is None else numpy_to_torch(w, query.dtype))


def _attention_int4(module, query, parts, attention_mask, scaling, is_causal, kwargs):
    """Attention over an :class:`Int4Cache` layer's parts: its 4-bit
    tokens (before the float window; no query of the call precedes them)
    and its float tokens (the window, then the call's own), merged by
    log-sum-exp; the output (B, L, H, Dv) in the query's dtype."""
    for k in ("position_bias", "s_aux", "sliding_window", "attncore_precision"):
        if kwargs.get(k) is not None:
            raise ValueError(f"Int4Cache: {k} is not available with the 4-bit cache (use the "
                             f"model's default cache)")
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None),
                                                  "output_attentions", False):
        raise ValueError("Int4Cache: output_attentions is not available with the 4-bit cache")
    torch = sys.modules["torch"]
    q = torch_to_numpy(query.float() if query.dtype != torch.float32 else query, "query",
                       remedy=_MOVE_MODEL)[0]
    quant, (fk, _) = parts
    L, S = q.shape[2], fk.shape[2] + (0 if quant is None else quant[0].shape[-2])
    causal, _, mask = _mask(module, attention_mask, is_causal, L, S, {})
    o = KVCache4.attend(q, parts, mask, "lower_right" if causal else False, scale=scaling,
                        enable_gqa=True, softcap=kwargs.get("softcap"),
                        num_threads=_threads(torch, *q.shape[:3], S, q.shape[3]))
    return numpy_to_torch(np.ascontiguousarray(o, np.float32), query.dtype
                          ).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------
# continuous batching: the "paged|eager" function
# --------------------------------------------------------------------------
def _paged_original():
    """transformers' function of ``"paged|eager"`` (what was registered
    under that key before attncore's)."""
    if _paged_previous is not None and _paged_previous is not paged_attention_forward:
        return _paged_previous
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    return eager_paged_attention_forward


def _offsets(kwargs, name, total):
    """The int64 NumPy offsets of the keyword ``name`` (a 1-D integer CPU
    tensor), checked against the packed length ``total``."""
    torch = sys.modules["torch"]
    cu = kwargs[name]
    if cu.ndim != 1 or cu.shape[0] < 1 or cu.dtype.is_floating_point or cu.dtype is torch.bool:
        raise ValueError(
            f"{name} must be a 1-D integer tensor of sequence offsets, got shape "
            f"{tuple(cu.shape)} and dtype {cu.dtype}")
    a = cu.detach().to("cpu", torch.int64).numpy()
    if a[-1] > total:
        raise ValueError(
            f"{name} ends at {int(a[-1])}, past the {total} packed positions given")
    return a


def _paged_unsupported(module, query, key, value, kwargs):
    """Why the call cannot run on attncore's varlen path (a sentence), ""
    when it is not a continuous-batching step at all, or None when it can."""
    torch = sys.modules["torch"]
    cu_k = kwargs.get("cu_seq_lens_k")
    if not (isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor)
            and (isinstance(cu_k, torch.Tensor) or kwargs.get("cache") is not None)):
        return ""           # an ordinary forward: transformers' function, silently
    if kwargs.get("block_table") is not None:
        return "the paged cache passes a block table instead of the gathered keys / values"
    if any(t.device.type != "cpu" for t in (query, key, value)):
        return f"the tensors are on {query.device} (attncore runs on the CPU)"
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4 or query.shape[0] != 1 \
            or key.shape[0] != 1 or value.shape[0] != 1:
        return "the queries / keys / values are not packed into one row"
    if not getattr(module, "is_causal", True):
        return "the layer is not causal"
    if kwargs.get("position_bias") is not None:
        return "position_bias is not supported by the varlen kernel"
    if kwargs.get("output_attentions"):
        return "attention weights were asked for"
    if query.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"dtype {query.dtype} is not supported"
    return None


_paged_warned: set = set()


def _paged_window(module, kwargs):
    """The sliding window of the layer in continuous batching, or None.

    transformers' paged cache and its mask take a layer as sliding-window
    attention by the config: ``layer_types[layer_idx] ==
    "sliding_attention"``, or every layer when the config has no
    ``layer_types`` but a ``sliding_window``; the window is then
    ``config.sliding_window`` keys ending at the query.  Otherwise the
    ``sliding_window`` keyword the layer passes, if any."""
    cfg = getattr(module, "config", None)
    w = None
    if cfg is not None and getattr(cfg, "sliding_window", None) is not None:
        types = getattr(cfg, "layer_types", None)
        idx = getattr(module, "layer_idx", None)
        if types is None or (isinstance(idx, int) and 0 <= idx < len(types)
                             and types[idx] == "sliding_attention"):
            w = cfg.sliding_window
    if w is None:
        w = kwargs.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
        raise ValueError(f"sliding_window must be a positive int, got {w!r}")
    return int(w)


def _sinks(module, kwargs):
    """The attention sinks of the layer (gpt-oss' ``s_aux``, one logit per
    head) or None."""
    torch = sys.modules["torch"]
    s = kwargs.get("s_aux")
    if s is None:
        s = getattr(module, "sinks", None)
    return s if isinstance(s, torch.Tensor) else None


def _paged_offsets(query, key, value, kwargs):
    """(cu_seq_lens_q, cu_seq_lens_k) of a continuous-batching step, checked
    against the packed tensors and each other."""
    total_q, total_k = query.shape[2], key.shape[2]
    if value.shape[2] != total_k:
        raise ValueError(f"key and value hold {total_k} and {value.shape[2]} positions; they "
                         f"must match")
    cq = _offsets(kwargs, "cu_seq_lens_q", total_q)
    ck = _offsets(kwargs, "cu_seq_lens_k", total_k)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k give {cq.shape[0] - 1} and "
                         f"{ck.shape[0] - 1} sequences; they must match")
    return cq, ck


def _paged_with_sinks(out, q, k, v, cq, ck, sinks, opts):
    """Attention with per-head ``sinks``, sequence by sequence, into the
    (total_q, H, Dv) tensor ``out``; ``opts``: the calls' keywords."""
    for b in range(cq.shape[0] - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            raise ValueError(f"sequence {b} has {q1 - q0} queries and no key "
                             f"(cu_seq_lens_k)")
        o = scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            is_causal="lower_right", enable_gqa=True, sinks=sinks, **opts)
        out[q0:q1] = o.transpose(0, 1)


def paged_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, **kwargs):
    """Attention of transformers' continuous batching, per sequence.

    Registered by :func:`register` under transformers' ``"paged|eager"``
    key.  In a continuous-batching step transformers packs the new tokens
    of all scheduled sequences into one row and its paged cache returns,
    for each sequence, its cached keys / values followed by the new ones;
    the keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` give each
    sequence's range.  attncore runs :func:`attncore.varlen_attention` on
    these: each sequence attends only its own keys, causal aligned
    lower-right per sequence (the new tokens are the last of its keys),
    sliding-window layers as the band of the ``sliding_window`` keys ending
    at each query (which layers, and the window, by the config's
    ``layer_types`` / ``sliding_window`` as transformers' paged cache and
    mask take them; else a ``sliding_window`` keyword), ``softcap`` fused,
    grouped-query heads read in place.  ``attention_mask`` (transformers'
    block-diagonal mask over all sequences) and the ``is_causal`` keyword
    that comes with it (False) are not read.  Layers with attention sinks (``s_aux`` or a
    ``sinks`` attribute, gpt-oss) run
    :func:`attncore.scaled_dot_product_attention` sequence by sequence.

    Calls that are not continuous-batching steps (no ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` tensors: ``"paged|eager"`` used with ``generate``)
    run transformers' own function unchanged.  So do steps the varlen path
    does not cover, with a ``RuntimeWarning`` naming the reason (once per
    reason): a block table instead of the gathered keys / values (a cache
    that passes ``block_table``), tensors off the CPU, queries / keys /
    values not packed into one row, non-causal layers, ``position_bias``,
    attention weights asked for, a dtype other than float32, float64,
    float16 and bfloat16.

    transformers 5.24 reads the paged cache in the model before this call;
    earlier 5.x releases pass the cache (keyword ``cache``) for the
    attention function to update and read, which this function then does
    as transformers' own.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (``is_causal``, ``sinks``, ``training``,
        ``layer_idx``, ``config``).
    query : torch.Tensor, (1, H, total_q, D)
    key, value : torch.Tensor, (1, Hkv, total_k, D)
        Hkv divides H.
    attention_mask : torch.Tensor or None
        Ignored on attncore's path (the offsets say which keys each query
        sees).
    dropout : float
        Must be 0 (inference only).
    scaling : float, optional
        Default ``D ** -0.5``.
    **kwargs
        ``cu_seq_lens_q``, ``cu_seq_lens_k`` (1-D integer tensors, B + 1
        offsets), ``max_length_q``, ``max_length_k`` (checked only),
        ``sliding_window``, ``softcap``, ``s_aux``, ``cache`` (see
        above); others are ignored.

    Returns
    -------
    attn_output : torch.Tensor, (1, total_q, H, D), contiguous
    attn_weights : None
    """
    reason = _paged_unsupported(module, query, key, value, kwargs)
    if reason is not None:
        if reason and reason not in _paged_warned:
            _paged_warned.add(reason)
            warnings.warn(f"attncore's continuous-batching attention falls back to transformers' "
                          f"'paged|eager' function: {reason}", RuntimeWarning, stacklevel=2)
        return _paged_original()(module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, **kwargs)
    _check_inference(module, query, key, value, dropout)
    torch = sys.modules["torch"]
    cache = kwargs.pop("cache", None)
    if cache is not None:
        # transformers < 5.24: the attention function writes the new keys /
        # values into the paged cache and reads each sequence's back (and
        # the layer type's cu_seq_lens_k), as transformers' own does
        key, value = cache.update(key_states=key, value_states=value,
                                  layer_idx=module.layer_idx, kwargs=kwargs)
    total_q = query.shape[2]
    cq, ck = _paged_offsets(query, key, value, kwargs)
    nq, nk = int(cq[-1]), int(ck[-1])   # past them: padding (static shapes)
    q = query[0, :, :nq].transpose(0, 1)      # (total_q, H, D) views
    k = key[0, :, :nk].transpose(0, 1)
    v = value[0, :, :nk].transpose(0, 1)
    window = _paged_window(module, kwargs)
    win = None if window is None else (window - 1, 0)
    nthreads = torch.get_num_threads()
    sinks = _sinks(module, kwargs)
    if sinks is None:
        mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        out = varlen_attention(
            q, k, v, cq, ck, is_causal=True, scale=scaling, window=win,
            softcap=kwargs.get("softcap"), enable_gqa=True, num_threads=nthreads,
            max_seqlen_q=mq if isinstance(mq, int) and mq >= 1 else None,
            max_seqlen_k=mk if isinstance(mk, int) and mk >= 1 else None)
    else:
        out = query.new_zeros((nq, query.shape[1], value.shape[3]))
        s = torch_to_numpy(sinks, "s_aux", remedy=_MOVE_MODEL)[0]
        _paged_with_sinks(out, q, k, v, cq, ck, s, dict(
            scale=scaling, window=win, softcap=kwargs.get("softcap"), num_threads=nthreads))
    if out.dtype is not query.dtype:
        out = out.to(query.dtype)
    if nq < total_q:
        out = torch.cat([out, out.new_zeros((total_q - nq,) + tuple(out.shape[1:]))])
    return out.unsqueeze(0).contiguous(), None

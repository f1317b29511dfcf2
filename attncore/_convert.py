"""Weight loaders of :class:`attncore.MultiHeadAttention` (private).

Each loader reads another framework's layout, checks it (every missing,
unexpected or misshaped tensor named) and returns the keyword arguments of
:meth:`MultiHeadAttention.from_arrays`: weights in PyTorch's Linear layout
(out_features, in_features), biases or None, head counts and dtype.  Nothing
here imports torch or Keras: modules and layers are read through their
``state_dict`` / ``get_weights`` / ``get_config`` methods.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._dtypes import half_code
from ._interop import weight_array
from ._validation import parse_positive_int

__all__ = ["torch_arrays", "keras_arrays"]


_BIAS_KV = "from_torch: add_bias_kv=True (bias_k, bias_v) is not supported"


def _torch_state(sd: Any, num_heads: Any) -> tuple[dict, int]:
    """(the state dict, num_heads) of a ``torch.nn.MultiheadAttention`` or
    of its state dict; a module's unsupported options refused."""
    if hasattr(sd, "state_dict") and hasattr(sd, "num_heads") and not isinstance(sd, dict):
        mod = sd
        if getattr(mod, "add_zero_attn", False):
            raise NotImplementedError("from_torch: add_zero_attn=True is not supported")
        if getattr(mod, "bias_k", None) is not None or getattr(mod, "bias_v", None) is not None:
            raise NotImplementedError(_BIAS_KV)
        if num_heads is not None and int(num_heads) != mod.num_heads:
            raise ValueError(f"num_heads={num_heads} disagrees with the module's "
                             f"num_heads={mod.num_heads}")
        num_heads = mod.num_heads
        sd = mod.state_dict()
    elif not hasattr(sd, "keys"):
        raise TypeError("state_dict_or_module must be a torch.nn.MultiheadAttention or a "
                        f"state dict (mapping), got {type(sd).__name__}")
    if num_heads is None:
        raise ValueError("from_torch: num_heads is required with a state dict")
    return dict(sd), parse_positive_int(num_heads, "num_heads")


def _torch_tensors(sd: dict) -> tuple[str, dict[str, np.ndarray]]:
    """(the common prefix of the names, the tensors as NumPy arrays by
    name without it); every missing or unexpected tensor named."""
    # strip a common prefix ("decoder.layers.0.self_attn.")
    anchor = [k for k in sd if k.endswith("out_proj.weight")]
    prefix = ""
    if len(anchor) == 1:
        prefix = anchor[0][: -len("out_proj.weight")]
    elif len(anchor) > 1:
        raise ValueError(f"from_torch: the state dict holds several attention layers "
                         f"({sorted(anchor)}); pass one layer's state dict")
    if prefix:
        others = [k for k in sd if not k.startswith(prefix)]
        if others:
            raise ValueError(f"from_torch: unexpected tensors {sorted(others)} (next to "
                             f"'{prefix}out_proj.weight')")
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    arr = {k: weight_array(v, prefix + k) for k, v in sd.items()}
    if "bias_k" in arr or "bias_v" in arr:
        raise NotImplementedError(_BIAS_KV)
    expected = ({"in_proj_weight"} if "in_proj_weight" in arr else
                {"q_proj_weight", "k_proj_weight", "v_proj_weight"}) | {"out_proj.weight"}
    optional = {"in_proj_bias", "out_proj.bias"}
    # (biases: both or neither)
    missing = sorted(expected - arr.keys()) + sorted(optional - arr.keys() if optional & arr.keys() else ())
    if missing:
        raise ValueError(f"from_torch: missing tensors {[prefix + m for m in missing]} "
                         f"(got {sorted(prefix + k for k in arr)})")
    extra = sorted(arr.keys() - expected - optional)
    if extra:
        raise ValueError(f"from_torch: unexpected tensors {[prefix + e for e in extra]}")
    return prefix, arr


def _shaped(arr: dict[str, np.ndarray], prefix: str, name: str, shape: tuple) -> np.ndarray:
    """Tensor ``name``, checked to have ``shape``."""
    a = arr[name]
    if a.shape != tuple(shape):
        raise ValueError(f"from_torch: {prefix}{name} must have shape {tuple(shape)}, "
                         f"got {a.shape}")
    return a


def torch_arrays(state_dict_or_module: Any, num_heads: Any = None, dtype: Any = None) -> dict:
    """``from_arrays`` arguments from a ``torch.nn.MultiheadAttention`` or its
    state dict (see :meth:`MultiHeadAttention.from_torch`)."""
    sd, H = _torch_state(state_dict_or_module, num_heads)
    prefix, arr = _torch_tensors(sd)
    ow = arr["out_proj.weight"]
    if ow.ndim != 2:
        raise ValueError(f"from_torch: {prefix}out_proj.weight must be 2-D (E, E), got shape "
                         f"{ow.shape}")
    E = ow.shape[0]
    if E % H:
        raise ValueError(f"from_torch: embed_dim={E} (from out_proj.weight) must be "
                         f"divisible by num_heads={H}")
    _shaped(arr, prefix, "out_proj.weight", (E, E))
    if "in_proj_weight" in arr:
        w = _shaped(arr, prefix, "in_proj_weight", (3 * E, E))
        qw, kw, vw = w[:E], w[E:2 * E], w[2 * E:]
    else:
        qw = _shaped(arr, prefix, "q_proj_weight", (E, E))
        kw, vw = arr["k_proj_weight"], arr["v_proj_weight"]
        for nm, a in (("k_proj_weight", kw), ("v_proj_weight", vw)):
            if a.ndim != 2 or a.shape[0] != E:
                raise ValueError(f"from_torch: {prefix}{nm} must have shape (E, in_features) "
                                 f"with E={E}, got {a.shape}")
    qb = kb = vb = ob = None
    if "in_proj_bias" in arr:
        b = _shaped(arr, prefix, "in_proj_bias", (3 * E,))
        qb, kb, vb = b[:E], b[E:2 * E], b[2 * E:]
        ob = _shaped(arr, prefix, "out_proj.bias", (E,))
    if dtype is None:  # float64 and 16-bit weights keep their dtype
        dtype = ow.dtype if (ow.dtype == np.float64 or half_code(ow.dtype)) else np.float32
    return dict(q_weight=qw, k_weight=kw, v_weight=vw, out_weight=ow, q_bias=qb, k_bias=kb,
                v_bias=vb, out_bias=ob, num_heads=H, num_kv_heads=H, dtype=dtype)


def _keras_source(obj: Any, config: Any) -> tuple[list, dict]:
    """(the weights, the config) of a Keras layer or of its
    ``get_weights()`` list and config; unsupported options refused."""
    if hasattr(obj, "get_weights") and hasattr(obj, "get_config"):
        cfg = obj.get_config()
        if not getattr(obj, "built", True) or not obj.get_weights():
            raise ValueError("from_keras: the layer has no weights yet; call it once (or "
                             "build it) before converting")
        weights = obj.get_weights()
        if cfg.get("attention_axes") is None and getattr(obj, "_attention_axes", None) \
                is not None:
            cfg = dict(cfg, attention_axes=obj._attention_axes)
    else:
        if isinstance(obj, np.ndarray) or not hasattr(obj, "__len__"):
            raise TypeError("layer_or_weights must be a keras.layers.MultiHeadAttention or "
                            f"its get_weights() list, got {type(obj).__name__}")
        weights = list(obj)
        cfg = dict(config) if config is not None else {}
    axes = cfg.get("attention_axes")
    if axes is not None:
        ax = tuple(int(a) for a in (axes if hasattr(axes, "__len__") else (axes,)))
        if ax not in ((1,), (-2,)):
            raise NotImplementedError(
                f"from_keras: attention_axes={axes!r} is not supported; only the default "
                "(attention over axis 1 of (batch, length, features) inputs)")
    if cfg.get("use_gate"):
        raise NotImplementedError("from_keras: use_gate=True is not supported")
    if cfg.get("sliding_window") is not None:
        raise NotImplementedError("from_keras: sliding_window is not supported")
    return weights, cfg


def _keras_kernels(ws: list[np.ndarray], cfg: dict) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """The kernels (query, key, value, output: the first of every pair with
    biases) and their sizes (E, H, key_dim, value_dim, out), checked."""
    qk, kk, vk, ok = kernels = ws[::2] if len(ws) == 8 else ws
    if qk.ndim != 3:
        raise ValueError(f"from_keras: query kernel must be (E, num_heads, key_dim), got "
                         f"shape {qk.shape}")
    E, H, kd = qk.shape
    if kk.ndim != 3 or kk.shape[1:] != (H, kd):
        raise ValueError(f"from_keras: key kernel must be (kdim, {H}, {kd}), got shape "
                         f"{kk.shape}")
    if vk.ndim != 3 or vk.shape[1] != H:
        raise ValueError(f"from_keras: value kernel must be (vdim, {H}, value_dim), got "
                         f"shape {vk.shape}")
    vd = vk.shape[2]
    if ok.ndim != 3 or ok.shape[:2] != (H, vd):
        if ok.ndim > 3 and ok.shape[:2] == (H, vd):
            raise NotImplementedError(
                f"from_keras: a multi-dimensional output_shape {ok.shape[2:]} is not "
                "supported")
        raise ValueError(f"from_keras: output kernel must be ({H}, {vd}, out), got shape "
                         f"{ok.shape}")
    if cfg.get("num_heads") is not None and int(cfg["num_heads"]) != H:
        raise ValueError(f"from_keras: config num_heads={cfg['num_heads']} but the kernels "
                         f"have {H} heads")
    return kernels, (E, H, kd, vd, ok.shape[2])


def _keras_bias(b: np.ndarray | None, shape: tuple, name: str) -> np.ndarray | None:
    """A bias checked to have ``shape``, flattened (None stays None)."""
    if b is None:
        return None
    if b.shape != shape:
        raise ValueError(f"from_keras: {name} bias must have shape {shape}, got "
                         f"{b.shape}")
    return b.reshape(-1)


def keras_arrays(layer_or_weights: Any, config: Any = None, dtype: Any = None) -> dict:
    """``from_arrays`` arguments from a Keras 3 ``MultiHeadAttention`` or its
    ``get_weights()`` list (see :meth:`MultiHeadAttention.from_keras`)."""
    weights, cfg = _keras_source(layer_or_weights, config)
    ws = [weight_array(w, f"weights[{i}]") for i, w in enumerate(weights)]
    if len(ws) not in (8, 4):
        raise ValueError(f"from_keras: expected 8 weight arrays (with biases) or 4 (without), "
                         f"got {len(ws)}")
    if cfg.get("use_bias") is not None and bool(cfg["use_bias"]) != (len(ws) == 8):
        raise ValueError(f"from_keras: config use_bias={cfg['use_bias']} but got {len(ws)} "
                         "weight arrays")
    (qk, kk, vk, ok), (E, H, kd, vd, out) = _keras_kernels(ws, cfg)
    qb, kb, vb, ob = ((_keras_bias(b, sh, nm) for b, sh, nm in zip(
        ws[1::2], ((H, kd), (H, kd), (H, vd), (out,)), ("query", "key", "value", "output")))
        if len(ws) == 8 else (None,) * 4)
    if dtype is None:
        dtype = np.float64 if qk.dtype == np.float64 else np.float32
    return dict(q_weight=qk.reshape(E, H * kd).T, k_weight=kk.reshape(kk.shape[0], H * kd).T,
                v_weight=vk.reshape(vk.shape[0], H * vd).T, out_weight=ok.reshape(H * vd, out).T,
                q_bias=qb, k_bias=kb, v_bias=vb, out_bias=ob, num_heads=H, num_kv_heads=H,
                dtype=dtype)

"""The peers of the side-by-side comparisons, built once per case.

ONNX Runtime runs two graphs: its contrib ``com.microsoft.MultiHeadAttention``
operator (query / key / value in the (batch, length, heads * dim) layout it
reads natively, so the timing carries no transposes) and the standard ONNX
``Attention`` operator (opset 23, (batch, heads, length, dim) inputs), each in
a session with ``intra_op_num_threads`` set to the thread count of the
comparison.  ``sgemm_gflops`` measures the machine's single-precision matrix
product rate through NumPy's BLAS in the same process, the ceiling prefill
is compared with.
"""
from __future__ import annotations

import time

import numpy as np

try:
    import onnxruntime as ort
    from onnx import TensorProto, helper
except ImportError:  # onnxruntime / onnx are benchmark extras
    ort = None


def available():
    return ort is not None


def _session(graph, threads, opset):
    model = helper.make_model(graph, opset_imports=opset)
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_mha(q, k, v, mask=None, causal=False, threads=1):
    """A callable running ``com.microsoft.MultiHeadAttention`` on (B, H, N, D)
    float32 inputs (laid out as (B, N, H*D) beforehand, outside the timing).

    mask: None or a key padding mask (B, 1, 1, M) bool, True = attend.
    Returns None when the case has no equivalent (other mask shapes).
    """
    if ort is None:
        return None
    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[3]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [B, N, H * D]),
              helper.make_tensor_value_info("k", f, [B, M, H * D]),
              helper.make_tensor_value_info("v", f, [B, M, H * Dv])]
    names = ["q", "k", "v"]
    feeds = {"q": np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B, N, H * D)),
             "k": np.ascontiguousarray(k.transpose(0, 2, 1, 3).reshape(B, M, H * D)),
             "v": np.ascontiguousarray(v.transpose(0, 2, 1, 3).reshape(B, M, H * Dv))}
    if mask is not None:
        if mask.shape != (B, 1, 1, M):
            return None
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT32, [B, M]))
        names += ["", "kpm"]  # bias absent, key_padding_mask (1 = attend)
        feeds["kpm"] = mask.reshape(B, M).astype(np.int32)
    node = helper.make_node("MultiHeadAttention", names, ["out"], domain="com.microsoft",
                            num_heads=H, unidirectional=int(bool(causal)))
    graph = helper.make_graph([node], "mha", inputs,
                              [helper.make_tensor_value_info("out", f, [B, N, H * Dv])])
    sess = _session(graph, threads, [helper.make_opsetid("", 21),
                                     helper.make_opsetid("com.microsoft", 1)])
    return lambda: sess.run(None, feeds)


def ort_attention(q, k, v, mask=None, causal=False, threads=1):
    """A callable running the ONNX ``Attention`` operator (opset 23) on
    (B, H, N, D) float32 inputs; mask: None or bool broadcastable to
    (B, H, N, M), True = attend."""
    if ort is None:
        return None
    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[3]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, list(q.shape)),
              helper.make_tensor_value_info("k", f, list(k.shape)),
              helper.make_tensor_value_info("v", f, list(v.shape))]
    names = ["q", "k", "v"]
    feeds = {"q": np.ascontiguousarray(q), "k": np.ascontiguousarray(k),
             "v": np.ascontiguousarray(v)}
    if mask is not None:
        # the operator wants the query axis of the mask spelled out
        mask = np.broadcast_to(mask, mask.shape[:-2] + (N, M))
        inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, list(mask.shape)))
        names.append("m")
        feeds["m"] = np.ascontiguousarray(mask)
    node = helper.make_node("Attention", names, ["out"], is_causal=int(bool(causal)))
    graph = helper.make_graph([node], "attn", inputs,
                              [helper.make_tensor_value_info("out", f, [B, H, N, Dv])])
    try:
        sess = _session(graph, threads, [helper.make_opsetid("", 23)])
    except Exception:  # an onnxruntime without opset 23
        return None
    return lambda: sess.run(None, feeds)


def sgemm_gflops(n=1024, repeats=5):
    """Best-of-``repeats`` float32 matrix product rate (GFLOP/s) through
    NumPy's BLAS at the thread count currently in force."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9

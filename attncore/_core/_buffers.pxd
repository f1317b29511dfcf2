# Buffer acquisition for the Python entry points of the kernels (cimport
# this file): every buffer taken goes into one _Buffers, and one call of
# _release_all in a `finally` gives them all back, in reverse order, however
# far the acquisition got.
#
#     cdef _Buffers bufs
#     bufs.n = 0
#     try:
#         bq = _acquire(&bufs, q, PyBUF_RECORDS_RO)
#         ...
#     finally:
#         _release_all(&bufs)
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release

cdef enum:
    _MAX_BUFFERS = 10  # the most any entry point takes (sdpa: q, k, v, out, mask, weights, lse, 3 scales)


cdef struct _Buffers:
    Py_buffer views[_MAX_BUFFERS]
    int n              # acquired so far: views[0:n]


cdef inline Py_buffer *_acquire(_Buffers *bufs, obj, int flags) except NULL:
    """Acquire obj's buffer into the next slot of bufs."""
    if bufs.n >= _MAX_BUFFERS:
        raise RuntimeError("attncore: too many buffers acquired")
    PyObject_GetBuffer(obj, &bufs.views[bufs.n], flags)
    bufs.n += 1
    return &bufs.views[bufs.n - 1]


cdef inline void _release_all(_Buffers *bufs) noexcept:
    """Release every acquired buffer (last first)."""
    while bufs.n > 0:
        bufs.n -= 1
        PyBuffer_Release(&bufs.views[bufs.n])

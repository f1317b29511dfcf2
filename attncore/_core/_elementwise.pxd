# A kernel's own elementwise function over a 1-D float32 / float64 array
# (cimport this file): the accuracy tests' window on exp and tanh.

ctypedef void (*_map_f32)(const float *x, float *y, Py_ssize_t n) noexcept nogil
ctypedef void (*_map_f64)(const double *x, double *y, Py_ssize_t n) noexcept nogil


cdef inline object _map_array(x, str name, _map_f32 f32, _map_f64 f64):
    """y = f(x) elementwise, x float32 (f32) or float64 (f64), 1-D."""
    import numpy as np
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    cdef const float[::1] xf
    cdef float[::1] yf
    cdef const double[::1] xd
    cdef double[::1] yd
    if x.dtype == np.float32:
        xf = x
        yf = y
        if x.shape[0]:
            f32(&xf[0], &yf[0], x.shape[0])
    elif x.dtype == np.float64:
        xd = x
        yd = y
        if x.shape[0]:
            f64(&xd[0], &yd[0], x.shape[0])
    else:
        raise TypeError(f"{name}: float32 or float64 expected, got {x.dtype}")
    return y

# OpenMP helpers usable from any attncore extension (cimport this file).
#
# The C block compiles with or without OpenMP: without it every query
# answers as a single-threaded runtime would, so the kernels still run
# (serially) and stay correct.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define AC_OPENMP_ENABLED 1
    #else
    #define AC_OPENMP_ENABLED 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_num_procs(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint AC_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
    int omp_get_num_procs() noexcept nogil
    int omp_get_thread_num() noexcept nogil

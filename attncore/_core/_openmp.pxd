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

    /* BLAS held to one thread in the calling thread only: the thread-local
       setters of the BLAS libraries (OpenBLAS >= 0.3.27
       openblas_set_num_threads_local, MKL mkl_set_num_threads_local), set
       up once from Python (attncore._threads).  Each thread that runs a
       kernel region holds, and releases on the way out; the depth counter
       makes nested holds (a serial call inside a held region) harmless.
       Nothing process-wide is touched. */
    #define AC_BLAS_MAX 8
    typedef int (*ac_blas_local_fn)(int);
    static ac_blas_local_fn ac_blas_local_fns[AC_BLAS_MAX];
    static int ac_blas_local_n = 0;
    #if defined(__GNUC__) || defined(__clang__)
    #define AC_TLS __thread
    #elif defined(_MSC_VER)
    #define AC_TLS __declspec(thread)
    #else
    #define AC_TLS _Thread_local
    #endif
    static AC_TLS int ac_blas_depth = 0;
    static AC_TLS int ac_blas_saved[AC_BLAS_MAX];

    static void ac_blas_set_local_fns(int n, const size_t *addr)
    {
        int i;
        if (n > AC_BLAS_MAX) n = AC_BLAS_MAX;
        for (i = 0; i < n; i++) ac_blas_local_fns[i] = (ac_blas_local_fn)addr[i];
        ac_blas_local_n = n;
    }
    static inline void ac_blas_hold(void)
    {
        int i;
        if (ac_blas_depth++ == 0)
            for (i = 0; i < ac_blas_local_n; i++)
                ac_blas_saved[i] = ac_blas_local_fns[i](1);
    }
    static inline void ac_blas_release(void)
    {
        int i;
        if (--ac_blas_depth == 0)
            for (i = 0; i < ac_blas_local_n; i++)
                ac_blas_local_fns[i](ac_blas_saved[i]);
    }
    """
    bint AC_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
    int omp_get_num_procs() noexcept nogil
    int omp_get_thread_num() noexcept nogil
    void ac_blas_set_local_fns(int n, const size_t *addr) noexcept nogil
    void ac_blas_hold() noexcept nogil
    void ac_blas_release() noexcept nogil


cdef inline void set_blas_local_fns(tuple addresses) noexcept:
    """Install the thread-local BLAS setters (addresses of C functions)."""
    cdef size_t addr[8]
    cdef int n = 0
    for a in addresses[:8]:
        addr[n] = <size_t>a
        n += 1
    ac_blas_set_local_fns(n, addr)

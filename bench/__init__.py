"""Benchmarks of attncore.

asv (airspeed velocity) imports every module of this package: the asv
benchmarks live in ``bench_*.py`` with their helpers in ``common.py``.
``compare*.py`` are standalone scripts (attncore vs PyTorch vs NumPy in one
run) and ``timing.py`` their shared timing method, not asv benchmarks: keep
asv's name prefixes (``time_``, ``timeraw_``, ``peakmem_``, ``mem_``,
``track_``) out of them, and keep them importable without torch.  See "Benchmarks" in README.md.
"""

"""Benchmarks of attncore.

asv (airspeed velocity) imports every module of this package: the asv
benchmarks live in ``bench_*.py`` with their helpers in ``common.py``.
``compare.py`` is a standalone script (attncore vs PyTorch vs NumPy in one
run), not an asv benchmark: keep asv's name prefixes (``time_``,
``timeraw_``, ``peakmem_``, ``mem_``, ``track_``) out of it, and keep it
importable without torch.  See "Benchmarks" in README.md.
"""

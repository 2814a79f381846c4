"""Test support, not part of the memlord package: ``browser`` drives a headless Chromium
over the HTML report, ``synthetic`` builds a profile of any size, ``lord_work`` makes a
lord after real work, ``trace`` checks the Chrome trace format's rules, ``memory_viz``
reads a pickle as torch's memory_viz does, ``ledger`` the measures memlord is compared with,
``warm`` runs Python code in a child of a warm interpreter that has imported torch once,
``cbuild`` builds the C libraries the tests
load (the fake CUDA driver, ``misbehaving``: two C functions that break CPython's call
protocol) (see tests/README.md).  Importable from the
tests as ``support.*`` (tests/, where conftest.py is, is on ``sys.path``) and from the
benchmarks (bench/bench_report.py puts tests/ on ``sys.path``)."""

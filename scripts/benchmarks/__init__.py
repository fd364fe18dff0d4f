"""The benchmarks behind ``scripts/bench.py``: one module per subcommand (``gpu_load.py`` is
``bench.py gpu-load``), each with a docstring that is its ``--help`` (what it measures, the
baseline it compares against, an example), ``add_arguments(parser)`` and ``run(args)``.
``common/`` holds what they share: alternation of candidates, CUDA timing, the table printer.
"""

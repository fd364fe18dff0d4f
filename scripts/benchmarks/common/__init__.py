"""What the benchmarks share: timing with alternation, CUDA timing, the table, argument helpers."""

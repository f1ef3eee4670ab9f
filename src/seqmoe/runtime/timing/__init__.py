"""Harnesses that time the runtime: greedy decode against the full model on the CPU (`decode`,
`seqmoe bench-runtime`), and real-size models forced to real routing (`forced`, `replay`). The
scripts in benchmarks/ call them.
"""

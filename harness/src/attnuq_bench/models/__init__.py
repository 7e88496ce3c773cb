"""Experiment architectures of the benchmark suites (the FT-Transformer builder, PatchTST, the ViT
field forecaster, the per-channel GP). Architectures only: they are trained through
:mod:`attnuq_bench.training`. Models a user builds on (the Levy forecaster) are in
:mod:`attnuq.models`.
"""

"""The CLI, the NCCL traffic generator and the benchmarks."""

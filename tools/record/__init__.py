"""`mirrorckpt record`: real NCCL traffic of a DDP-shaped job, recorded with its truth (docs/record.md).

``machine`` (what the machine has and lacks), ``nccl`` (a ctypes driver of one libnccl.so.2),
``workload`` (one rank), ``recorder`` (namespaces, rxe, tcpdump, ranks), ``truth`` (the ranks'
records merged into truth.json), ``verify`` (the replay check), ``command`` (the CLI).
"""

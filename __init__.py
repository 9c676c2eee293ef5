"""mirrorckpt: a checkpoint appliance fed by a switch mirror of NCCL ring all-reduce traffic.

Data flows one way: capture (frame batches) -> parser (RoCE, PSN reassembly, NCCL sends, ring
schedule, concatenator) -> updater (CPU replica, persistence). config holds the job layout,
control the trainer-facing control plane, tools the CLI, generator and benchmarks.
"""

__version__ = "0.1.0"

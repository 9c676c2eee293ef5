"""The NCCL traffic generator: a real training job simulated in one process (train), the
collectives DDP issues, and the RoCEv2 frames NCCL's ring would put on the wire (packetize)."""

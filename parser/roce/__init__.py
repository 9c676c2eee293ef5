"""RoCEv2 and NCCL: frames -> RDMA messages (PSN reassembly) -> NCCL sends -> placements.

    frames.py       the compiled frame walk: Ethernet, VLAN, IPv4/IPv6, UDP 4791, BTH..., ICRC
    reassembly.py   RDMA WRITE messages per QP, placed by PSN
    sends.py        what a send is: ConnKey, NcclSend, LazySend
    nccl.py         NCCL sends: CTS pairing, the split form, protocols (nccl_runs.py: whole runs at once)
    nccl_versions.py, protocols.py, schedule.py   NCCL's facts per release, payload codecs, ring schedule
    statemachine.py, channels.py, placer.py       which collective and message each send is
    infer.py, ringfind.py, protowalk.py           what the traffic says when no configuration does
    collectives.py  the job's collectives with NCCL's plan of each
    streams.py, jobstream.py, packet_path.py, split.py   capture files -> sends -> items

The package's face is the frame walk: ``roce.decode(batch)``, ``roce.Counters``, ``roce.RocePackets``.
"""

from mirrorckpt.parser.roce.frames import ICRC_BACKEND, SLOW_ICRC, Counters, RocePackets, decode  # noqa: F401

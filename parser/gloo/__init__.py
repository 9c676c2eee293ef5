"""PyTorch DDP over gloo/TCP, the second transport: TCP segments -> byte streams (tcp.py) -> gloo
ops (framing.py) -> placements of the job's collectives (schedule.py, placer.py), composed by
``job.GlooJobStream``. It shares the parser's transport-neutral core (concatenator, pipeline) and
imports nothing of ``parser.roce``."""

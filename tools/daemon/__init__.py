"""The daemon's stages, wired together by ``tools.serve``.

    worker.py   one capture process per mirror port (or per worker of a split port): capture,
                compact, decode threads; typed messages to the main process
    streams.py  the workers' sends as one ``parser.streams.SendStream`` (re-arm, release read off the wire)
    ports.py    each port's counters: metrics, drops, uneven splits, what the port sees (silence)
    stages.py   the parser and updater threads' loops
    rings.py    a sharded job's [[ring]] tables: one Daemon per ring, the joint checkpoint, the job's verdict
    logs.py     JSON-line (or text) logs
"""

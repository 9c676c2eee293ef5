"""The shared-memory ring that carries capture workers' send bytes to the parser (tools/sendring)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time

import numpy as np
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.tools.sendring import SendRing

CTX = mp.get_context("spawn")


def send(nbytes: int, seed: int) -> NcclSend:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8)
    return NcclSend(connection=ConnKey(b"a" * 16, b"b" * 16, 1), qp=None, protocol="Simple", data=data, holes=[],
                    wire_bytes=nbytes, size=nbytes, va=seed, form="normal", ts_ns=seed)


def through(ring: SendRing, parser: SendRing, sends: list) -> list:
    """What the parser gets: each queue item pickled as the multiprocessing queue does."""
    out = []
    for bare, span in ring.pack(sends):
        out += parser.unpack(pickle.loads(pickle.dumps(bare)), span)
    return out


def test_sends_arrive_whole_in_order_across_many_wraps():
    ring = SendRing(CTX, 1 << 16)  # 16 KiB chunks
    parser = ring  # the parser's side (one process here; see the next test for two)
    sizes = [0, 1, 4096, 5000, 16384, 16385, 70000, 3, 12000] * 20  # empty, chunk-sized, larger than a chunk
    sends = [send(n, k) for k, n in enumerate(sizes)]
    want = [s.data.copy() for s in sends]
    for k in range(0, len(sends), 3):
        got = through(ring, parser, sends[k:k + 3])  # the parser places them and drops them
        assert [g.va for g in got] == [s.va for s in sends[k:k + 3]]
        for g, w in zip(got, want[k:k + 3]):
            assert g.data.dtype == np.uint8 and np.array_equal(g.data, w)
    assert ring.written > 10 * ring.nbytes  # the ring was reused many times over
    for s, w in zip(sends, want):  # the worker's own sends keep their bytes (its decoder may hold them)
        assert np.array_equal(s.data, w)


def test_a_send_still_held_keeps_its_chunk_and_kept_sends_let_go(monkeypatch):
    """The parser's sends are views of the ring: a chunk is written again only once every send of
    it is dropped, so their bytes never change under them. A ring that stays full behind a chunk
    still in use sends the next chunk pickled after STUCK_S instead of waiting on; a send kept past
    its batch (``keep``) takes its own copy and the chunk goes back."""
    from mirrorckpt.tools import sendring

    monkeypatch.setattr(sendring, "STUCK_S", 0.2)
    ring = SendRing(CTX, 1 << 16)  # four 16 KiB chunks
    (held,) = through(ring, ring, [send(16000, 1)])
    want = held.data.copy()
    for k in range(2, 5):  # the other three chunks, each dropped at once
        through(ring, ring, [send(16000, k)])
    t = time.monotonic()
    ((bare, span),) = ring.pack([send(16000, 5)])  # it would reuse the held send's chunk
    assert span is None and time.monotonic() - t >= 0.2
    assert np.array_equal(bare[0].data, send(16000, 5).data)  # pickled with its bytes
    assert np.array_equal(held.data, want)  # never written under it
    assert held.keep() is held and held.data.base is None and np.array_equal(held.data, want)
    t = time.monotonic()
    for k in range(6, 30):  # its chunk went back: the ring turns again, nothing waits
        (got,) = through(ring, ring, [send(16000, k)])
        assert np.array_equal(got.data, send(16000, k).data)
    assert time.monotonic() - t < 0.2 and ring.written > 4 * ring.nbytes
    assert np.array_equal(held.data, want)


def test_a_full_ring_waits_for_the_parser_and_gives_up_when_told():
    ring = SendRing(CTX, 1 << 16)
    items = list(ring.pack([send(16384, k) for k in range(4)]))  # the whole ring in flight, nothing copied out
    assert all(span is not None for _, span in items)
    stop = threading.Event()
    done = []
    t = threading.Thread(target=lambda: done.append(list(ring.pack([send(100, 9)], stop.is_set))))
    t.start()
    time.sleep(0.3)
    assert not done  # waiting for room
    ring.unpack(*items.pop(0))  # the parser reads one chunk's sends and drops them: room again
    t.join(5)
    assert done and done[0][0][1] is not None
    full = SendRing(CTX, 1 << 16)
    list(full.pack([send(16384, k) for k in range(4)]))
    stop.set()
    ((bare, span),) = full.pack([send(100, 7)], stop.is_set)
    assert span is None and np.array_equal(bare[0].data, send(100, 7).data)  # pickled with its bytes instead


def _worker(ring: SendRing, q) -> None:
    for k in range(0, 60, 20):  # each call more than the ring holds
        for bare, span in ring.pack([send(1000 * (j % 13), j) for j in range(k, k + 20)]):
            q.put((bare, span))
    q.put(None)


def test_a_spawned_worker_hands_its_sends_through_the_ring():
    ring = SendRing(CTX, 1 << 15)
    q = CTX.Queue(maxsize=4)  # the worker must wait for room in the ring, not only in the queue
    p = CTX.Process(target=_worker, args=(ring, q))
    p.start()
    got = []
    while (item := q.get(timeout=60)) is not None:
        for g in ring.unpack(*item):  # each checked, then dropped as the parser drops it
            assert np.array_equal(g.data, send(1000 * (g.va % 13), g.va).data)
            got.append(g.va)
    p.join(30)
    assert p.exitcode == 0
    assert got == list(range(60))


def _lazy_sends(name: str) -> list:
    """Sends of a bundled capture as read ahead from its files: Simple and LL ones still in their
    batches (nccl.LazySend), their bytes not read yet."""
    from common import PCAPS
    from mirrorckpt.capture.pcapfile import open_capture
    from mirrorckpt.parser.roce.streams import MirrorStreams

    files = sorted((PCAPS / name).glob("*.pcap*"))
    return [s for sends in MirrorStreams([(str(p), open_capture(p, batch_frames=64)) for p in files], ahead=1)
            for s in sends]


def test_sends_still_in_their_batches_go_through_the_ring_with_their_bytes():
    """A send whose bytes are still in its capture batch (Simple wire bytes, LL words as the decode
    read them) is copied from there into the ring and arrives as a plain send with the bytes its
    ``data`` reads; pickled whole (``own``) it takes its bytes, not its batch and run."""
    from mirrorckpt.parser.roce.nccl import LazySend
    from mirrorckpt.tools.sendring import own

    for name, proto in (("simple_r3_both", "Simple"), ("demo", "LL")):
        sends = _lazy_sends(name)
        lazy = [s for s in sends if isinstance(s, LazySend) and s.__dict__.get("_source") is not None]
        assert len(lazy) > 10 and {s.protocol for s in lazy} == {proto}
        ring = SendRing(CTX, 1 << 22)
        got = through(ring, ring, lazy)
        alone = [pickle.loads(pickle.dumps(own(s))) for s in lazy[:5]]
        assert all(s.__dict__.get("_source") is not None for s in lazy)  # none was filled by that
        for g, s in zip(got, lazy):
            assert type(g) is NcclSend and (g.flag, g.va, g.nbytes) == (s.flag, s.va, s.nbytes)
            assert np.array_equal(g.data, s.data.view(np.uint8))
        for a, s in zip(alone, lazy):
            assert type(a) is NcclSend and np.array_equal(a.data, s.data.view(np.uint8))

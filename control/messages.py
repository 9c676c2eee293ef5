"""The control-plane message types: an explicit registry with a schema for each type's body.

Every type says who may send it (the trainer is the client, the appliance the server), which body
fields it has and whether it carries tensors. Unknown types, missing, extra or mistyped fields are
rejected with a ``SchemaError``/``UnknownMessageType`` before any handler sees the message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from mirrorckpt.config.layout import JobLayout, RingSpec
from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.control import wire
from mirrorckpt.control.wire import SchemaError, UnknownMessageType

HELLO = "HELLO"  # handshake: role and nonce
AUTH = "AUTH"  # handshake: proof of the secret over both nonces and roles
REGISTER = "REGISTER"  # job layout, ring, training recipe, initial state (tensors, groups, schedule);
#                        a sharded job's DP group adds the job's sharded layout and which group it is
STEP_META = "STEP_META"  # what the wire does not carry: lr, loss scale, rng, data position, plateau state,
#                          the clip coefficient and the skip decision the trainer took
FINGERPRINT = "FINGERPRINT"  # per-tensor u64 fingerprints and distance stats (updater.fingerprint) at a step
FALLBACK_REQUEST = "FALLBACK_REQUEST"  # appliance asks for a GoCkpt multi-step checkpoint
GOCKPT_PART = "GOCKPT_PART"  # part i of k: fp32 state slices, gradients (job dtype) of the parts already sent
GOCKPT_DONE = "GOCKPT_DONE"
RESTORE_REQUEST = "RESTORE_REQUEST"  # trainer pulls state from the appliance
RESTORE_STATE = "RESTORE_STATE"
ACK = "ACK"
ERROR = "ERROR"
PING = "PING"
PONG = "PONG"

CLIENT, SERVER, ANY = "client", "server", "any"  # client = trainer, server = appliance
U64 = (1 << 64) - 1
ROLE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_HEX32 = re.compile(r"[0-9a-f]{64}")
MAX_STR = 4096


@dataclass(frozen=True)
class F:
    """One body field: its kind, and whether it may be absent or null."""

    kind: str  # int, num, bool, str, role, hex32, dict, json, u64map
    required: bool = True
    nullable: bool = False


@dataclass(frozen=True)
class Spec:
    sender: str
    fields: dict[str, F]
    tensors: str = "none"  # none | any | uint8
    check: Callable[[dict], str | None] | None = None  # cross-field check: error text or None


def _kind_error(kind: str, v) -> str | None:
    if kind == "int":
        return None if wire.is_int(v) else "a non-negative integer"
    if kind == "num":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return None if ok else "a finite number"
    if kind == "bool":
        return None if isinstance(v, bool) else "true or false"
    if kind == "str":
        return None if isinstance(v, str) and len(v) <= MAX_STR else f"a string of at most {MAX_STR} characters"
    if kind == "role":
        return None if isinstance(v, str) and ROLE.fullmatch(v) else "a role name ([a-z][a-z0-9_-]*)"
    if kind == "hex32":
        return None if isinstance(v, str) and _HEX32.fullmatch(v) else "64 lowercase hex digits"
    if kind == "dict":
        return None if isinstance(v, dict) else "an object"
    if kind == "json":
        return None
    if kind == "u64map":
        ok = isinstance(v, dict) and all(wire.is_int(x, hi=U64) for x in v.values())
        return None if ok else "an object of unsigned 64-bit integers"
    raise AssertionError(kind)


def _layout_error(name: str, cls, d) -> str | None:
    # The layout classes do the semantic checks; any failure of theirs is a schema error here.
    try:
        cls.from_dict(d)
    except Exception as e:  # noqa: BLE001 - whatever a hostile dict provokes
        return f"{name} is not a valid {cls.__name__}: {type(e).__name__}: {str(e)[:100]}"
    return None


def _check_register(b: dict) -> str | None:
    err = _layout_error("layout", JobLayout, b["layout"])
    if err is None and b.get("ring") is not None:
        err = _layout_error("ring", RingSpec, b["ring"])
    if err is None:
        err = _layout_error("training", TrainingSpec, b["training"])
    if err is None and ("shards" in b or "group" in b):
        err = sharded_register_error(b)
    return err


def sharded_register_error(b: dict) -> str | None:
    """A sharded REGISTER names its DP group and carries the job's ShardedLayout; the registered
    layout must be that group's ring: its slices, under their global FQNs, in the group's order."""
    if "shards" not in b or "group" not in b:
        return "a sharded registration carries both shards (the job's sharded layout) and group"
    err = _layout_error("shards", ShardedLayout, b["shards"])
    if err is not None:
        return err
    sl = ShardedLayout.from_dict(b["shards"])
    if sl.refusal is not None and not b.get("weights_only"):
        return f"{sl.refusal} (a registration of such a job says weights_only)"
    if sl.refusal is None and b.get("weights_only"):
        return "weights_only registers a job whose optimizer state cannot be followed; this layout's can"
    try:
        want = [(p.name, tuple(p.shape)) for p in sl.group_params(b["group"])]
    except KeyError as e:
        return str(e.args[0] if e.args else e)
    got = [(p.name, tuple(p.shape)) for p in JobLayout.from_dict(b["layout"]).params]
    if got != want:
        diff = next((f"{g} vs {w}" for g, w in zip(got, want) if g != w), f"{len(got)} vs {len(want)} parameters")
        return f"layout is not the ring of DP group {b['group']!r} of the sharded layout (first difference: {diff})"
    return None


def _check_step_meta(b: dict) -> str | None:
    unused = b.get("unused")
    if unused is not None and not (isinstance(unused, list) and all(isinstance(n, str) for n in unused)):
        return "unused must be a list of parameter names"
    hp = b.get("hparams")
    if hp is not None and not (isinstance(hp, list) and all(isinstance(d, dict) for d in hp)):
        return "hparams must be a list of objects, one per param group"
    clip = b.get("clip")
    if clip is None:
        return None
    if set(clip) != {"total_norm", "coef"} or any(_kind_error("num", v) for v in clip.values()):
        return "clip must be {total_norm, coef}, finite numbers"
    if not 0 < clip["coef"] <= 1 or clip["total_norm"] < 0:
        return "clip coef must be in (0, 1] and total_norm >= 0"
    return None


def _check_part(b: dict) -> str | None:
    return None if 1 <= b["parts"] and b["index"] < b["parts"] else "part index must be < parts >= 1"


def _check_parts(b: dict) -> str | None:
    return None if b["parts"] >= 1 else "parts must be >= 1"


REGISTRY: dict[str, Spec] = {
    HELLO: Spec(ANY, {"role": F("role"), "nonce": F("hex32")}),
    AUTH: Spec(ANY, {"proof": F("hex32")}),
    REGISTER: Spec(CLIENT, {"job": F("str"), "step": F("int"), "layout": F("dict"),
                            "ring": F("dict", required=False, nullable=True), "training": F("dict"),
                            "state_meta": F("dict", required=False),
                            # one id per trainer start: a new one is a restarted job (new communicator)
                            "run": F("str", required=False),
                            # sharded jobs (config.shards): the job's layout and this link's DP group;
                            # weights_only: a job whose optimizer state the wire does not carry
                            "shards": F("dict", required=False), "group": F("str", required=False),
                            "weights_only": F("bool", required=False)},
                   tensors="any", check=_check_register),
    STEP_META: Spec(CLIENT, {"step": F("int"), "lr": F("num"), "loss_scale": F("num", nullable=True),
                             "data_position": F("json", required=False),
                             "lr_scheduler": F("str", required=False),
                             # a reported schedule: each param group's hyper-parameters after the step
                             "hparams": F("json", required=False),
                             # DDP find_unused_parameters: the parameters no rank used this step
                             "unused": F("json", required=False),
                             # the clip the trainer applied (updater.replica multiplies by coef)
                             "clip": F("dict", required=False, nullable=True),
                             # the trainer skipped this step's optimizer update (inf/nan)
                             "skipped": F("bool", required=False)}, tensors="uint8", check=_check_step_meta),
    # tensors: "s:<key>" float64 distance stats (updater.fingerprint.stats) per fingerprinted key
    FINGERPRINT: Spec(CLIENT, {"step": F("int"), "fingerprints": F("u64map")}, tensors="any"),
    FALLBACK_REQUEST: Spec(SERVER, {"reason": F("str"), "step": F("int"), "parts": F("int")},
                           check=_check_parts),
    GOCKPT_PART: Spec(CLIENT, {"step": F("int"), "index": F("int"), "parts": F("int"),
                               "slices": F("dict", required=False)}, tensors="any", check=_check_part),
    GOCKPT_DONE: Spec(CLIENT, {"step": F("int"), "parts": F("int"),
                               "fingerprints": F("u64map", required=False)}, tensors="any", check=_check_parts),
    # allow_behind: the trainer takes a state further behind its last reported step than the
    # appliance's protection limit (refused otherwise: a restore never rolls a job back in silence)
    RESTORE_REQUEST: Spec(CLIENT, {"step": F("int", required=False, nullable=True),
                                   "allow_behind": F("bool", required=False)}),
    RESTORE_STATE: Spec(SERVER, {"step": F("int"), "layout": F("dict", required=False),
                                 "meta": F("dict", required=False)}, tensors="any"),
    ACK: Spec(ANY, {"info": F("dict", required=False)}),
    ERROR: Spec(ANY, {"reason": F("str"), "code": F("str", required=False)}),
    PING: Spec(ANY, {}),
    PONG: Spec(ANY, {}),
}
HANDSHAKE = frozenset({HELLO, AUTH})


def validate(mtype, body: dict, dtypes: dict[str, str], sender: str | None = None) -> Spec:
    """Check a message of type ``mtype`` against its schema; ``sender`` is CLIENT or SERVER."""
    spec = REGISTRY.get(mtype) if isinstance(mtype, str) else None
    if spec is None:
        raise UnknownMessageType(f"unknown message type {mtype!r:.60}")
    if sender is not None and spec.sender not in (ANY, sender):
        raise SchemaError(f"{mtype} may not be sent by the {sender}")
    extra = body.keys() - spec.fields.keys()
    if extra:
        raise SchemaError(f"{mtype}: unknown field(s) {', '.join(sorted(map(str, extra))[:5])}")
    for name, f in spec.fields.items():
        if name not in body:
            if f.required:
                raise SchemaError(f"{mtype}: missing field {name!r}")
            continue
        v = body[name]
        if v is None and f.nullable:
            continue
        want = _kind_error(f.kind, v)
        if want is not None:
            raise SchemaError(f"{mtype}: field {name!r} must be {want}")
    if spec.tensors == "none" and dtypes:
        raise SchemaError(f"{mtype} carries no tensors, got {len(dtypes)}")
    if spec.tensors == "uint8":
        bad = [n for n, d in dtypes.items() if d != "uint8"]
        if bad:
            raise SchemaError(f"{mtype}: tensor {bad[0]!r} must be raw bytes (uint8)")
    if spec.check is not None:
        err = spec.check(body)
        if err:
            raise SchemaError(f"{mtype}: {err}")
    return spec


@dataclass
class Message:
    """One message. Received tensors are torch views of the frame's payload buffer."""

    type: str
    body: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # name -> torch.Tensor or numpy array
    rid: int | None = None  # request id, when the sender waits for a reply
    re: int | None = None  # the request id this message answers
    seq: int | None = None  # set when sent or received

    def array(self, name: str) -> np.ndarray:
        """numpy view of a tensor (bfloat16 as raw uint16 bits)."""
        return wire.as_numpy(self.tensors[name])


def make(mtype: str, tensors: dict | None = None, *, rid: int | None = None, re: int | None = None,
         **body) -> Message:
    """Build a message, checked against its schema now so a sender's mistake shows at the call."""
    tensors = dict(tensors or {})
    dtypes = {n: wire.tensor_to_wire(t)[0] for n, t in tensors.items()}
    validate(mtype, body, dtypes)
    return Message(mtype, body, tensors, rid=rid, re=re)


def reply(request: Message, mtype: str = ACK, **body) -> Message:
    return make(mtype, re=request.rid, **body)


def fingerprints(step: int, named: dict[str, torch.Tensor]) -> Message:
    """FINGERPRINT message of ``{name: updater.fingerprint.fingerprint(tensor)}``."""
    from mirrorckpt.updater.fingerprint import fingerprint
    return make(FINGERPRINT, step=step, fingerprints={n: fingerprint(t) for n, t in named.items()})


def encode_payload(msg: Message) -> tuple[list[dict], list, int]:
    """(tensor table, payload pieces, payload length) of ``msg``, checked against its schema."""
    table, pieces, n = wire.encode_tensors(msg.tensors)
    validate(msg.type, msg.body, {e["name"]: e["dtype"] for e in table})
    return table, pieces, n


def encode_header(msg: Message, seq: int, table: list[dict], stream: int | None = None) -> bytes:
    """The header of ``msg`` sent as number ``seq``; ``stream``: payload bytes of a stream head."""
    header = {"v": wire.VERSION, "type": msg.type, "seq": seq, "body": msg.body, "tensors": table}
    if msg.rid is not None:
        header["rid"] = msg.rid
    if msg.re is not None:
        header["re"] = msg.re
    if stream is not None:
        header["stream"] = stream
    return wire.dumps_header(header)


def encode(msg: Message, seq: int) -> tuple[bytes, list, int]:
    """(header bytes, payload pieces, payload length) of ``msg`` sent as number ``seq``."""
    table, pieces, n = encode_payload(msg)
    return encode_header(msg, seq, table), pieces, n


def check_header(raw_header: bytes, payload_len: int, sender: str | None = None) -> dict:
    """Parse a frame's header and check it against the registry (nothing of the payload is read)."""
    h = wire.parse_header(raw_header, payload_len)
    validate(h["type"], h["body"], {e["name"]: e["dtype"] for e in h["tensors"]}, sender)
    return h


def from_header(h: dict, payload) -> Message:
    """The message of a checked header whose payload (numpy uint8) is complete."""
    return Message(h["type"], h["body"], wire.decode_tensors(h["tensors"], payload),
                   rid=h.get("rid"), re=h.get("re"), seq=h["seq"])


def from_frame(raw: wire.RawFrame, sender: str | None = None) -> Message:
    """Parse and check a frame's header, then rebuild its tensors (only after all checks)."""
    h = check_header(raw.header, raw.payload.size, sender)
    if "stream" in h:
        raise wire.MalformedFrame("a stream head cannot be read as a frame of its own")
    return from_header(h, raw.payload)


def parse(data: bytes, max_frame: int = wire.MAX_FRAME, sender: str | None = None) -> Message:
    """One unauthenticated frame held in memory to a message; raises only ``ProtocolError``."""
    return from_frame(wire.decode_frame(data, max_frame), sender)


def to_bytes(msg: Message, seq: int = 0) -> bytes:
    """One unauthenticated frame as bytes (handshake frames, tests, fuzzing)."""
    header, pieces, n = encode(msg, seq)
    return b"".join(bytes(p) for p in wire.pack(header, pieces, n))

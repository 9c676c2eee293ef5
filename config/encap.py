"""How mirror copies reach the appliance: bare, or inside a remote mirror's encapsulation.

``[capture] encapsulation`` pins it ("auto", the default, takes off whichever of them a frame
carries): "none" (a local SPAN port: bare frames only), "erspan" (ERSPAN type I, II, III over
GRE), "gre" (gretap, and a vendor's GRE protocol with a fixed header), "vxlan". ``vxlan_port``
moves VXLAN off its UDP port 4789; ``gre_protocol`` with ``gre_header_bytes`` names a vendor's
GRE protocol and the bytes between its GRE header and the mirrored frame (SONiC on NVIDIA
Spectrum: 0x8949 and 22, which "auto" and "gre" take off unless told otherwise). A configured
protocol is tried before the built-in rules, so ERSPAN's 0x88BE with its own length serves a
switch whose header after GRE is not the standard's.
"""

from __future__ import annotations

from dataclasses import dataclass

ENCAPSULATIONS = ("auto", "none", "erspan", "gre", "vxlan")
MAX_GRE_HEADER_BYTES = 128


@dataclass(frozen=True)
class EncapSpec:
    mode: str = "auto"
    vxlan_port: int | None = None  # None: VXLAN's own port
    gre_protocol: int | None = None  # None: the SONiC/Spectrum default
    gre_header_bytes: int | None = None

    def __post_init__(self):
        if self.mode not in ENCAPSULATIONS:
            raise ValueError(f"encapsulation: expected one of {', '.join(ENCAPSULATIONS)}, got {self.mode!r}")
        if self.vxlan_port is not None:
            if not 1 <= self.vxlan_port <= 0xFFFF:
                raise ValueError(f"vxlan_port: expected a UDP port 1..65535, got {self.vxlan_port!r}")
            if self.mode not in ("auto", "vxlan"):
                raise ValueError(f"vxlan_port: applies with encapsulation \"auto\" or \"vxlan\", not {self.mode!r}")
        if (self.gre_protocol is None) != (self.gre_header_bytes is None):
            given, missing = ("gre_protocol", "gre_header_bytes") if self.gre_protocol is not None \
                else ("gre_header_bytes", "gre_protocol")
            raise ValueError(f"{given}: needs {missing} too (a vendor's GRE protocol and the bytes of "
                             "its header before the mirrored frame)")
        if self.gre_protocol is not None:
            if not 0 <= self.gre_protocol <= 0xFFFF:
                raise ValueError(f"gre_protocol: expected a 16-bit GRE protocol type, got {self.gre_protocol!r}")
            if not 0 <= self.gre_header_bytes <= MAX_GRE_HEADER_BYTES:
                raise ValueError(f"gre_header_bytes: expected 0..{MAX_GRE_HEADER_BYTES}, "
                                 f"got {self.gre_header_bytes!r}")
            if self.mode not in ("auto", "gre"):
                raise ValueError(f"gre_protocol: applies with encapsulation \"auto\" or \"gre\", not {self.mode!r}")

    @classmethod
    def from_capture(cls, capture: dict) -> EncapSpec:
        """The spec of a job file's (checked) [capture] table."""
        return cls(capture.get("encapsulation", "auto"), capture.get("vxlan_port"), capture.get("gre_protocol"),
                   capture.get("gre_header_bytes"))

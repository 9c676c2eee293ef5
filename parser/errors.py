"""Errors the parser raises when the traffic and what was stated about it disagree."""

from __future__ import annotations


class InferenceError(Exception):
    """The traffic does not determine the job; the message says what is missing."""


class VersionMismatch(InferenceError):
    """A stated NCCL version (--nccl-version, [ring] nccl_version) contradicts the wire."""

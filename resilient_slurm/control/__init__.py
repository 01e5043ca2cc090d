"""Per-node control socket: versioned, length-prefixed JSON between the launcher and its ranks.

See :mod:`resilient_slurm.control.protocol` for the wire contract and message types,
:mod:`resilient_slurm.control.server` for the launcher side and :mod:`resilient_slurm.control.client`
for the rank side. Standard library only: importing this package does not import torch.
"""

from __future__ import annotations

from .client import ControlClient
from .protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    ErrorCode,
    default_runtime_dir,
    default_socket_path,
)
from .server import ControlServer, ControlState, PeerCredentials, RankInfo, SaveRequest

__all__ = [
    "ControlClient",
    "ControlServer",
    "ControlState",
    "ErrorCode",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "PeerCredentials",
    "RankInfo",
    "SUPPORTED_VERSIONS",
    "SaveRequest",
    "default_runtime_dir",
    "default_socket_path",
]

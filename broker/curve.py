"""The instance's CURVE key pair for a ``tcp://`` overlay.

Every rank of an instance holds the same key pair (as Flux ranks share one
instance certificate).  The ROUTER side is a CURVE server and only admits
clients whose public key is the instance's: a ZAP handler (pyzmq's
``ThreadAuthenticator``) checks each connecting key.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import zmq
import zmq.auth.thread

ZAP_DOMAIN = "kvbroker"
"""The ZAP domain of every overlay ROUTER (pyzmq matches it exactly; ``*``
only stands for sockets that set no domain)."""

KEY_FILE_MAX = 4096
"""Bytes of a key file read at most: `keygen`'s is 82; a longer one is not one."""


def generate_keys(path: str) -> tuple[bytes, bytes]:
    """Create the key pair file (mode 0600) and return ``(public, secret)``."""
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(public + b"\n" + secret + b"\n")
    return public, secret


def load_keys(path: str) -> tuple[bytes, bytes]:
    """The (public, secret) pair in a ``kvbroker keygen`` file, checked:
    ValueError saying what is wrong (ZeroMQ's own "Invalid argument" at
    start-up named neither the file nor the fault)."""
    # (non-blocking: a FIFO named here hung the rank, waiting for a writer)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file (a key pair file, as `kvbroker keygen` "
                             "writes)")
        words = f.read(KEY_FILE_MAX + 1).split()
    if len(words) != 2 or any(len(w) != 40 for w in words):
        raise ValueError("not a key pair file (two 40-character Z85 keys, as "
                         "`kvbroker keygen` writes)")
    public, secret = words
    try:
        derived = zmq.curve_public(secret)
        zmq.utils.z85.decode(public)
    except (ValueError, KeyError, zmq.ZMQError):  # (z85.decode: KeyError for a stray byte)
        raise ValueError("not a key pair file (the keys are not Z85)") from None
    if derived != public:
        raise ValueError("the public key is not the secret key's (the lines swapped, or "
                         "from two files?)")
    return public, secret


def loose_mode(path: str) -> bool:
    """Whether others than the owner may read the key file (it should be 0600)."""
    return bool(os.stat(path).st_mode & 0o077)


class _InstanceKeyOnly:
    """ZAP credentials callback: admit only the instance's own public key."""

    def __init__(self, public: bytes) -> None:
        self.public_z85 = public

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands the client's key over z85-encoded (40 bytes).
        if len(key) == 32:
            key = zmq.utils.z85.encode(key)
        return key == self.public_z85


def start_authenticator(ctx: zmq.Context[Any],
                        public: bytes) -> zmq.auth.thread.ThreadAuthenticator:
    """Run a ZAP handler in ``ctx`` that admits only the instance's key."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                  credentials_provider=_InstanceKeyOnly(public))
    return auth

"""The KVS's checkpoint value, as the content service and the kvs module
both read it: ``{rootref, rootseq, timestamp, leases?}`` (kvbroker's), or
Flux's ``{version, rootref, sequence, timestamp}``.  One definition, so a
value ``content.checkpoint-put`` takes is one the next start resumes from
(a put of ``sequence: -4`` was answered ``{}``, and the start then failed).
"""

from __future__ import annotations

from typing import Any

from broker.content import blobref


def rootseq_of(value: dict[str, Any]) -> Any:
    """The version a KVS checkpoint's root is at: ``rootseq``, or in Flux's
    form its ``sequence``, optional there (0); None if it says none (not
    checked to be an int)."""
    if "rootseq" in value:
        return value["rootseq"]
    return value.get("sequence", 0) if "version" in value else None


def is_kvs_root(value: Any) -> bool:
    """Whether ``value`` names a KVS root a start can resume from: a valid
    ``rootref`` and a version (an int, not a bool, at least 0)."""
    if not (isinstance(value, dict) and blobref.is_valid(value.get("rootref"))):
        return False
    seq = rootseq_of(value)
    return type(seq) is int and seq >= 0

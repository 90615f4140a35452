"""Host lists as Flux writes them (RFC 29): ``node[0-3,7]``, ``a,b``.

``kvbroker overlay lookup`` translates between ranks and hosts with these,
as ``flux overlay lookup`` does.  A list keeps its order and its repeats
(one entry per rank: four ranks on one host are ``myhost,myhost,myhost,myhost``);
:func:`encode` folds adjacent names that differ only in a trailing number
into one bracketed range, and :func:`expand` reads that back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_HOSTS = 1 << 20
"""The most names :func:`expand` makes (``node[0-999999999]`` is refused,
not built)."""

_NUMBERED = re.compile(r"(.*?)(\d+)\Z")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?\Z")


def expand(text: str) -> list[str]:
    """The names of host list ``text``, in order; ``ValueError`` saying what
    is wrong with it (an empty name, an unclosed bracket, a range that
    does not ascend, more than :data:`MAX_HOSTS` names)."""
    hosts: list[str] = []
    for item in _split_top(text):
        if "[" not in item:
            if not item or "]" in item:
                raise ValueError(f"not a host name: {item!r} (in {text!r})")
            hosts.append(item)
            continue
        prefix, _, rest = item.partition("[")
        ranges, close, suffix = rest.partition("]")
        if close and "[" not in ranges and "[" in suffix and suffix.count("[") == suffix.count("]"):
            raise ValueError(f"only one bracketed range per name: {item!r}")
        if not close or "[" in ranges or "[" in suffix or "]" in suffix:
            raise ValueError(f"unbalanced brackets in {item!r}")
        for part in ranges.split(","):
            m = _RANGE.match(part)
            if m is None:
                raise ValueError(f"not a number or range: {part!r} (in {item!r})")
            lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
            lo, hi = int(lo_text), int(hi_text)
            if hi < lo:
                raise ValueError(f"range {part!r} does not ascend (in {item!r})")
            if len(hosts) + hi - lo + 1 > MAX_HOSTS:
                raise ValueError(f"{text!r} names more than {MAX_HOSTS} hosts")
            width = len(lo_text) if lo_text.startswith("0") else 0
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(lo, hi + 1))
    return hosts


def _split_top(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def encode(hosts: Iterable[str]) -> str:
    """``hosts`` as one host list: runs of adjacent names with the same
    prefix and number width folded into ``prefix[ranges]`` (but for a
    name that repeats the one before it), so that :func:`expand` gives
    back the same names in the same order."""
    groups: list[tuple[str, int, list[int]]] = []  # (prefix, width, numbers) or (name, -1, [])
    for host in hosts:
        m = _NUMBERED.match(host)
        if m is None:
            groups.append((host, -1, []))
            continue
        prefix, digits = m.group(1), m.group(2)
        padded = digits.startswith("0") and len(digits) > 1
        n = int(digits)
        if groups:
            last_prefix, width, numbers = groups[-1]
            fits = len(digits) == width if width > 0 else not padded
            if last_prefix == prefix and fits and numbers and numbers[-1] != n:
                numbers.append(n)
                continue
        groups.append((prefix, len(digits) if padded else 0, [n]))
    parts = []
    for prefix, width, numbers in groups:
        if width < 0:
            parts.append(prefix)
        elif len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
        else:
            parts.append(f"{prefix}[{_ranges(numbers, width)}]")
    return ",".join(parts)


def _ranges(numbers: list[int], width: int) -> str:
    """``0-3,7`` for 0, 1, 2, 3, 7: ascending runs, in the order given."""
    out: list[str] = []
    lo = hi = numbers[0]
    for n in numbers[1:]:
        if n == hi + 1:
            hi = n
            continue
        out.append(_run(lo, hi, width))
        lo = hi = n
    out.append(_run(lo, hi, width))
    return ",".join(out)


def _run(lo: int, hi: int, width: int) -> str:
    return f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}"

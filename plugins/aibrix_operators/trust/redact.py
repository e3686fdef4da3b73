"""Addresses out of messages a batch's submitter reads (error lines, a Batch API batch's errors).

Exception texts name where they failed: aiohttp's ``Cannot connect to host vllm.batch.svc:8000``,
an OS error's ``('::1', 8000, 0, 0)``. A Batch API tenant must not learn the deployment's layout
from them (the task log keeps the detail). What counts as an address here: a URL of any scheme
or a ``//host`` reference, an IPv4 or IPv6 address (with its port), a ``host:port``.
"""

from __future__ import annotations

import ipaddress
import re

INTERNAL = "<internal address>"

_URL = r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"()<>,;]+"
_NETLOC = r"(?<![\w/:])//[A-Za-z0-9\[][^\s'\"()<>,;/]*"
_BRACKETED_V6 = r"\[[0-9A-Fa-f:.%\w]+\](?::\d{1,5})?"
_IPV4 = r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
# A host has a letter somewhere ("12:30" is a time, "1:2" a ratio).
_HOST_PORT = (r"\b(?=[A-Za-z0-9.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
              r"(?:\.[A-Za-z0-9-]+)*:\d{1,5}\b")
_ADDRESS = re.compile("|".join((_URL, _NETLOC, _BRACKETED_V6, _IPV4, _HOST_PORT)))
# IPv6 without brackets (a socket address tuple's host): candidates checked by ipaddress, so
# that "12:30" or "a:b" are left alone.
_V6_CANDIDATE = re.compile(r"(?<![\w:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?:%\w+)?(?![\w:.])")


def _v6(match: re.Match[str]) -> str:
    text = match.group(0)
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return text
    return INTERNAL


def scrub_addresses(text: str) -> str:
    """``text`` with every address replaced by ``<internal address>``."""
    return _V6_CANDIDATE.sub(_v6, _ADDRESS.sub(INTERNAL, text))


def scrub_json(value: object) -> object:
    """``value`` (a decoded JSON body) with every string scrubbed; keys are kept."""
    if isinstance(value, str):
        return scrub_addresses(value)
    if isinstance(value, dict):
        return {k: scrub_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_json(v) for v in value]
    return value

"""How a checkpoint store's spec is shown (CLI lines and hints, logs, errors, ``runs list``): a
``postgresql://`` URL without its password, which is a secret that terminals, logs and CI output keep.

One function, ``redact_url``, for every place a spec is shown. It parses the URL (urllib.parse) instead of
matching a pattern: a password may hold a raw ``@`` (the user info ends at the last one), be
percent-encoded, or be a ``password=`` query parameter. ``scrub`` takes the password out of text that did
not come from flowrt (a driver's error message may quote its connection string).
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

__all__ = ["redact_url", "scrub", "MASK"]

MASK = "***"


def _text(spec: Any) -> str:
    return os.fsdecode(spec) if isinstance(spec, (str, bytes, os.PathLike)) else str(spec)


def _query(query: str) -> str:
    """The query string with every ``password=`` value masked (the other parameters as written)."""
    out = []
    for part in query.split("&"):
        key, sep, _ = part.partition("=")
        out.append(f"{key}={MASK}" if sep and urllib.parse.unquote_plus(key).strip().lower() == "password" else part)
    return "&".join(out)


def redact_url(spec: Any) -> str:
    """``spec`` as it may be shown: a URL's password (in its user info or a ``password=`` query parameter) as
    ``***``; a spec that is not a URL (an SQLite path) as it is."""
    text = _text(spec)
    if "://" not in text:
        return text
    scheme, _, rest = text.partition("://")
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        return f"{scheme}://{MASK}"
    if "@" in parts.path + parts.query + parts.fragment:
        # A raw '/', '?' or '#' in the password ended the URL's authority early (libpq reads it alike): all
        # up to the last '@' is masked (a legitimate '@' in a parameter hides a little more than needed).
        return redact_url(f"{scheme}://{MASK}@{rest.rsplit('@', 1)[1]}")
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        if ":" in userinfo:
            netloc = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, _query(parts.query), parts.fragment))


def _secrets(url: str) -> set[str]:
    """The password of ``url`` in every form it may be quoted in: as written and percent-decoded."""
    found: set[str] = set()
    if "://" not in url:
        return found
    rest = url.partition("://")[2]
    if "@" in rest:
        userinfo = rest.rsplit("@", 1)[0]
        if ":" in userinfo:
            found.add(userinfo.partition(":")[2])
    for part in url.partition("?")[2].partition("#")[0].split("&"):
        key, sep, value = part.partition("=")
        if sep and urllib.parse.unquote_plus(key).strip().lower() == "password":
            found.add(value)
    decoded = {urllib.parse.unquote(s) for s in found} | {urllib.parse.unquote_plus(s) for s in found}
    return {s for s in found | decoded if s}


def scrub(text: str, url: Any) -> str:
    """``text`` with ``url``'s password (as written or decoded) masked wherever it occurs."""
    for secret in sorted(_secrets(_text(url)), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text

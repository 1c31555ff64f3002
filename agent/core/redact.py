"""Secrets out of log lines before they leave the device.

A line is redacted in two ways:

- **by shape**: a PEM block or its armour line, `Authorization:`/`Bearer`/`Basic` credentials, a
  URL's `user:password@`, and the value after a secret-sounding name (`password=`, `passwd:`,
  `secret`, `token`, `api_key`, `private_key`, `credential`, `psk`, `auth`, in `k=v`, `k: v`,
  `"k": "v"` and `--k v` forms);
- **by value**: each string in `literals` (what the device knows is secret: its broker password,
  its claim credential, its enrolment token) wherever it appears, whatever surrounds it.

What is taken out becomes `[redacted]`. Redaction errs toward taking too much: a log line that
lost a harmless value is better than a key on the operator's screen.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "[redacted]"
LITERAL_MIN = 4  # shorter "secrets" would take every match of a common word with them

_NAMES = (r"pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|client[_-]?secret"
          r"|credentials?|psk|auth(?:_?key)?|session[_-]?key|cookie")
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|$)", re.DOTALL)
_PEM_LINE = re.compile(r"-----(?:BEGIN|END) [A-Z0-9 ]*PRIVATE KEY-----")
_SCHEME = re.compile(r"\b(Bearer|Basic|Digest)\s+[A-Za-z0-9._~+/=-]{6,}", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s:@]*:[^/\s@]+@", re.IGNORECASE)
_VALUE = r"""(?P<value>"[^"]*"|'[^']*'|[^\s,;&}]+)"""
_NAMED = re.compile(  # k=v, k: v, "k": "v"
    r"""(?P<name>(?<![\w.-])["']?[\w.-]{0,32}(?:""" + _NAMES + r""")[\w.-]{0,32}["']?)(?P<sep>\s*[:=]\s*)"""
    + _VALUE, re.IGNORECASE)
_OPTION = re.compile(  # --password v, -p v is not named: only long options
    r"""(?P<name>(?<![\w-])--[\w-]{0,32}(?:""" + _NAMES + r""")[\w-]{0,32})(?P<sep>\s+)""" + _VALUE, re.IGNORECASE)


def _named(match: re.Match[str]) -> str:
    value = match.group("value")
    if value.strip("\"'") == REDACTED:
        return match.group(0)
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{match.group('name')}{match.group('sep')}{quote}{REDACTED}{quote}"


def redact(line: str, literals: Iterable[str] = ()) -> str:
    """`line` with every secret it shows replaced by `[redacted]`."""
    for literal in literals:
        if len(literal) >= LITERAL_MIN and literal in line:
            line = line.replace(literal, REDACTED)
    line = _PEM.sub(REDACTED, line)
    line = _PEM_LINE.sub(REDACTED, line)
    line = _SCHEME.sub(lambda m: f"{m.group(1)} {REDACTED}", line)
    line = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", line)
    return _OPTION.sub(_named, _NAMED.sub(_named, line))


def redact_lines(lines: Iterable[str], literals: Iterable[str] = ()) -> list[str]:
    """Each line redacted; a line inside a PEM block (between its BEGIN and END lines) is dropped
    whole, since its base64 carries no name that would say what it is."""
    secrets = [s for s in literals if len(s) >= LITERAL_MIN]
    out: list[str] = []
    inside = False
    for line in lines:
        if "-----BEGIN " in line and "-----END " not in line:
            inside = True
            out.append(REDACTED)
            continue
        if inside:
            if "-----END " in line:
                inside = False
            continue
        out.append(redact(line, secrets))
    return out


__all__ = ["REDACTED", "redact", "redact_lines"]

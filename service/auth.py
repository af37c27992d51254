"""API keys: where they come from, how a request presents one, and rotation without a restart.

Sources, all merged: the serve config's `api_keys`, the key file (`--api-key-file` or the
config's `api_key_file`: one key per line, blank lines and `#` comments skipped) and the
SYNAPSE_API_KEYS environment variable (comma-separated). Never a command-line argument: any
local user can read those in `ps`.

A request presents a key as `Authorization: Bearer KEY` (what OpenAI clients send) or
`x-api-key: KEY`. Only SHA-256 digests of the keys are kept, and a presented key is compared
against every one of them with `hmac.compare_digest`, so neither timing nor an early exit says
which key (or how much of one) matched. No key is ever logged, counted or echoed back.

SIGHUP re-reads the key file; the config's and the environment's keys stay as they were.
A key file that cannot be read or holds no key is a config error at start; on a reload it
keeps the old keys (an emptied file must never silently open the server).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping

from common.errors import SynapseError
from host.errors import ConfigInvalid

log = logging.getLogger("synapse.serve")

ENV_VAR = "SYNAPSE_API_KEYS"


class AuthenticationFailed(SynapseError):
    """401: no key, or one this server does not know. Never carries the key."""

    code = "invalid_api_key"
    http_status = 401


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_key_file(path: str) -> list[str]:
    try:
        # utf-8-sig: a byte-order mark (Windows editors, PowerShell) is not part of a key.
        text = open(path, encoding="utf-8-sig").read()  # read at once
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigInvalid(f"cannot read API key file {path}: {type(exc).__name__}") from None
    keys = [line.strip() for line in text.splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


class ApiKeys:
    """The set of accepted keys, as digests."""

    def __init__(
        self,
        config_keys: list[str],
        key_file: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = (environ if environ is not None else os.environ).get(ENV_VAR, "")
        self._fixed = {_digest(k.strip()) for k in [*config_keys, *env.split(",")] if k.strip()}
        self.key_file = key_file
        self._from_file: set[bytes] = set()
        if key_file is not None:
            self._from_file = {_digest(k) for k in read_key_file(key_file)}
            if not self._from_file:  # a server told to use keys must never start open
                raise ConfigInvalid(f"API key file {key_file} holds no key")
        self._digests = tuple(self._fixed | self._from_file)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self) -> bool:
        """Re-read the key file (SIGHUP). False, keeping the old keys, if it cannot be read."""
        if self.key_file is None:
            return True
        try:
            keys = read_key_file(self.key_file)
        except ConfigInvalid as exc:
            log.warning("API keys not reloaded: %s", exc.message)
            return False
        if not keys:  # caught mid-rewrite, or emptied: never drop (or open) on that
            log.warning("API keys not reloaded: %s holds no key", self.key_file)
            return False
        self._from_file = {_digest(k) for k in keys}
        self._digests = tuple(self._fixed | self._from_file)
        return True

    def accepts(self, presented: str) -> bool:
        digest = _digest(presented)
        matched = False
        for known in self._digests:  # no early exit: every key costs the same
            matched |= hmac.compare_digest(digest, known)
        return matched


def presented_key(headers: Mapping[bytes, bytes]) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key`."""
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, value = auth.partition(b" ")
        if scheme.lower() == b"bearer" and value.strip():
            return value.strip().decode("latin-1")
    key = headers.get(b"x-api-key")
    if key is not None and key.strip():
        return key.strip().decode("latin-1")
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def exposure_warning(host: str, keys: ApiKeys) -> str | None:
    """The one-line start-up warning for an open server on a non-loopback address."""
    if keys.enabled or is_loopback(host):
        return None
    return (
        f"synapse serve: WARNING: no API key is configured and {host} is not a loopback "
        f"address: anyone who can reach this port can use it (see --api-key-file)"
    )

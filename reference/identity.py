"""R17: who a request belongs to, for rate limiting (pure Python, no vLLM).

``extra_args["output_rate_user"]`` (``vllm_xargs`` in the OpenAI API) if present, else the
shared bucket ``"__anonymous__"``. The OpenAI ``user`` field plays no part. The value is not
authenticated: with ``output_rate.identity`` set to ``"header:NAME"`` or ``"api-key"`` the
server binds it to a gateway's header or to the API key instead (R30-R32, below, and
``identity_middleware.py``).

Decision (docs, R17): a valid user id is a non-empty ``str`` of at most 256 characters.
Anything else is refused for that request only, at the front end (``plugin.py``) with a
``ValueError`` naming the value; a scheduler that still receives such a request (the plugin
not loaded) charges it to ``"__anonymous__"`` and logs the value, because raising inside
the engine core would fail every request in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

ANONYMOUS_USER = "__anonymous__"
USER_KEY = "output_rate_user"
MAX_USER_ID_CHARS = 256


def is_user_id(value: object) -> TypeGuard[str]:
    """R17: ``value`` is a valid user id, a non-empty ``str`` of at most
    ``MAX_USER_ID_CHARS`` (256) characters (the one test: requests, the per-user overrides
    and saved scenarios all use it)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_USER_ID_CHARS


def validate_extra_args(extra_args: Mapping[str, Any] | None) -> str:
    """R17: the user of a request with these ``extra_args``.

    Raises:
        ValueError: the value is not a non-empty string of at most 256 characters; the
            message names the field and the value (truncated to 80 characters).
    """
    if not extra_args or USER_KEY not in extra_args:
        return ANONYMOUS_USER
    user = extra_args[USER_KEY]
    if not is_user_id(user):
        raise ValueError(
            f"vllm_xargs.{USER_KEY} must be a non-empty string of at most {MAX_USER_ID_CHARS} "
            f"characters, got {user!r:.80}"
        )
    return user


# -- R30-R32: identity an operator can trust (docs/SPEC.md, "R30: bound identity") --------
IDENTITY_BODY = "body"
IDENTITY_API_KEY = "api-key"
HEADER_PREFIX = "header:"
ON_CLAIM = ("refuse", "overwrite")  # R31: a body that names its own user
ON_MISSING = ("refuse", "anonymous")  # R32: a request with no identity
_HEADER_NAME_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass(frozen=True)
class IdentitySettings:
    """R30-R32: where a request's user comes from (``output_rate.identity`` and friends).

    ``mode``: ``"body"`` (R17 as before: the client's ``vllm_xargs.output_rate_user``),
    ``"header"`` (the value of header ``header``, lower case, set by a gateway) or
    ``"api-key"`` (the user whose hash in ``keys_file`` matches the bearer token).
    ``on_claim``: ``"refuse"`` (HTTP 400 naming the field) or ``"overwrite"`` for a body
    that names a user (R31). ``on_missing``: ``"refuse"`` (HTTP 401) or ``"anonymous"``
    (charged to ``__anonymous__``) for a request without identity (R32).
    """

    mode: str = IDENTITY_BODY
    header: str | None = None
    keys_file: str | None = None
    on_claim: str = "refuse"
    on_missing: str = "refuse"

    @property
    def bound(self) -> bool:
        """True unless the client's body names the user (``mode == "body"``)."""
        return self.mode != IDENTITY_BODY


def parse_identity(
    identity: Any, keys_file: Any = None, on_claim: Any = None, on_missing: Any = None
) -> IdentitySettings:
    """R30-R32: validated ``IdentitySettings`` from the ``output_rate`` values ``identity``,
    ``keys_file``, ``identity_on_claim`` and ``identity_on_missing`` (None: not given).

    Raises:
        ValueError: an unknown mode, a bad header name, ``api-key`` without ``keys_file``
            (or a keys file without ``api-key``), an unknown ``on_claim``/``on_missing``, or
            either given with ``body``; the message names the value and what to change.
    """
    mode = IDENTITY_BODY if identity is None else identity
    header = None
    if isinstance(mode, str) and mode.startswith(HEADER_PREFIX):
        header = mode[len(HEADER_PREFIX) :]
        if not header or not set(header) <= _HEADER_NAME_CHARS:
            raise ValueError(
                f"identity {mode!r}: {header!r} is not an HTTP header name (letters, digits and "
                '!#$%&\'*+-.^_`|~ only), e.g. "header:X-User-Id"'
            )
        header, mode = header.lower(), "header"
    elif mode not in (IDENTITY_BODY, IDENTITY_API_KEY):
        raise ValueError(
            f'identity must be "body" (the default: the client names its user), "header:NAME" (a gateway '
            f'sets header NAME) or "api-key" (the user of the bearer token, from keys_file), got {identity!r}'
        )
    if mode == IDENTITY_API_KEY and keys_file is None:
        raise ValueError('identity "api-key" needs keys_file (--keys-file FILE): the JSON file of key hashes per user')
    if keys_file is not None and mode != IDENTITY_API_KEY:
        raise ValueError(
            f'keys_file is given but identity is {identity or "body"!r}: set identity to "api-key", or remove keys_file'
        )
    if keys_file is not None and (not isinstance(keys_file, str) or not keys_file.strip()):
        raise ValueError(f"keys_file must be a non-empty string naming the keys file, got {keys_file!r}")
    for name, value, allowed in (
        ("identity_on_claim", on_claim, ON_CLAIM),
        ("identity_on_missing", on_missing, ON_MISSING),
    ):
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if value is not None and mode == IDENTITY_BODY:
            raise ValueError(
                f'{name} applies only when identity is "header:NAME" or "api-key"; remove it, or set identity'
            )
    return IdentitySettings(mode, header, keys_file, on_claim or "refuse", on_missing or "refuse")

"""R17: who a request belongs to, for rate limiting (pure Python, no vLLM).

``extra_args["output_rate_user"]`` (``vllm_xargs`` in the OpenAI API) if present, else the
shared bucket ``"__anonymous__"``. The OpenAI ``user`` field plays no part. The value is not
authenticated: a trusted gateway must overwrite it.

Decision (docs, R17): a valid user id is a non-empty ``str`` of at most 256 characters.
Anything else is refused for that request only, at the front end (``plugin.py``) with a
``ValueError`` naming the value; a scheduler that still receives such a request (the plugin
not loaded) charges it to ``"__anonymous__"`` and logs the value, because raising inside
the engine core would fail every request in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
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

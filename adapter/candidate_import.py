"""Importing a module the operator names on the command line: the candidate scheduler's
module (``--scheduler-cls``, ``--async-scheduler-cls``), a ``hook:`` configuration function's
module (``--config-style``) or a mutant catalogue (``--mutants-from``).

Whatever such a module raises while it is imported is the operator's problem to fix before
the gate can judge anything (exit 2), never a verdict on the candidate's scheduling (exit 1).
``import_named_module`` turns it into one ``CandidateImportError`` that names the module and
the exception; only "this module is not on the import path" stays a ``ModuleNotFoundError``,
the one case where the ``--path`` hint applies.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class CandidateImportError(ImportError):
    """A named module was found but raised while it was imported (its message names the
    module and the exception: ``importing pkg.mod failed: RuntimeError: boom``)."""


def _is_the_module_or_above(missing: str | None, module_name: str) -> bool:
    """``missing`` (a ``ModuleNotFoundError``'s ``name``) is ``module_name`` or a package above it."""
    return missing is not None and (module_name == missing or module_name.startswith(f"{missing}."))


def import_named_module(module_name: str) -> ModuleType:
    """Import ``module_name`` (a dotted module name on the import path) and return it.

    Raises:
        ModuleNotFoundError: ``module_name`` itself, or a package above it, is not on the
            import path (Python's own error: ``No module named 'pkg'``).
        CandidateImportError: the module was found but its import raised: an import of its
            own that is missing (the message names it as the module's own import), a
            ``SyntaxError``, or any other exception (or ``SystemExit``) at import time; the
            message names ``module_name``, the exception's type and its message.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_the_module_or_above(exc.name, module_name):
            raise
        own = f" ({exc.name} is {module_name}'s own import: install it, or give --path for its directory too)"
        raise CandidateImportError(
            f"importing {module_name} failed: ModuleNotFoundError: {exc}{own if exc.name else ''}", name=module_name
        ) from exc
    except (Exception, SystemExit) as exc:  # the module's own code raised while it ran
        raise CandidateImportError(
            f"importing {module_name} failed: {type(exc).__name__}: {exc}", name=module_name
        ) from exc

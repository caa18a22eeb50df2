"""Optional dependencies: imported on first need, with a message that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from retrieval.errors import RetrievalError


def require(module: str, extra: str) -> ModuleType:
    """Imports module, or raises RetrievalError saying which extra of the package brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise RetrievalError(
            f"{module} is not installed ({error}); install it with: pip install 'retrieval[{extra}]'"
        ) from None

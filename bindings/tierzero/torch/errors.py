"""How a failure is passed on in tierzero.torch: as a note on the exception the caller sees, or as the
refusal a collective carries (the engine's agree, set_master and checkpoint calls take one), so every rank
fails together instead of one waiting for the others."""

from __future__ import annotations

import warnings
from typing import Optional


def _add_note(e: BaseException, text: str) -> None:
    """Adds `text` to the exception's message (Python 3.11's add_note; before it, a warning)."""
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _refusal_text(failure: Optional[BaseException]) -> Optional[str]:
    return None if failure is None else f"{type(failure).__name__}: {failure}"

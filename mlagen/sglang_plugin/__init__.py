"""SGLang integration of mlagen: the ``mlagen`` attention backend.

SGLang (0.5.22 / 0.5.23) runs every callable registered under the ``sglang.srt.plugins`` entry-point
group via ``sglang.srt.plugins.load_plugins()`` early in each process (launcher / ``sglang serve``,
``Engine``, scheduler and detokenizer subprocesses). Our entry point is :func:`register`; it

1. registers the backend factory in SGLang's ``ATTENTION_BACKENDS`` (used by the scheduler's
   ModelRunner), and
2. adds ``mlagen`` to ``--attention-backend`` / ``--prefill-attention-backend`` /
   ``--decode-attention-backend`` choices (``add_attention_backend_choices``).

Both steps are idempotent. Importing this package is cheap (no torch, no SGLang).
"""

from __future__ import annotations

import logging

BACKEND_NAME = "mlagen"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "mlagen"
ENTRY_POINT_VALUE = "mlagen.sglang_plugin:register"

logger = logging.getLogger(__name__)


def add_backend_choice() -> bool:
    """Add ``mlagen`` to SGLang's attention-backend CLI choices. Returns True if it was added now."""
    from sglang.srt.arg_groups import choices

    if BACKEND_NAME in choices.ATTENTION_BACKEND_CHOICES:
        return False
    choices.add_attention_backend_choices([BACKEND_NAME])
    return True


def register_factory() -> bool:
    """Register the backend factory in SGLang's attention registry. Returns False (and logs a
    warning) when the registry cannot be imported in this process (a partial SGLang install);
    the scheduler process, which builds the backend, imports it in any case."""
    try:
        from sglang.srt.layers.attention import attention_registry
    except ImportError as e:
        logger.warning("mlagen: SGLang attention registry not importable here (%s); "
                       "the mlagen backend factory is not registered in this process", e)
        return False
    if BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS:
        attention_registry.register_attention_backend(BACKEND_NAME)(_factory)
    return True


def _factory(runner):
    from mlagen.sglang_plugin.backend import create_mlagen_backend

    return create_mlagen_backend(runner)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the factory, then the CLI choice."""
    register_factory()
    add_backend_choice()


__all__ = ["BACKEND_NAME", "ENTRY_POINT_GROUP", "ENTRY_POINT_NAME", "ENTRY_POINT_VALUE",
           "add_backend_choice", "register", "register_factory"]

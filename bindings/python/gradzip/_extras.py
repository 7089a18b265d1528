"""Optional dependencies: the packages a part of gradzip needs beyond torch come with an extra of
the distribution (``[project.optional-dependencies]`` in pyproject.toml), e.g.
``pip install 'gradzip[converge]'``. Modules import them through :func:`require`, so that a missing
one is reported with the extra that provides it. ``import gradzip`` and ``gradzip.ddp`` need none.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# Import names whose distribution (the name pip installs) differs.
DISTRIBUTIONS = {"PIL": "pillow"}


def distribution(module: str) -> str:
    """The distribution that provides ``module`` (``PIL.Image`` -> ``pillow``)."""
    top = module.partition(".")[0]
    return DISTRIBUTIONS.get(top, top)


def require(module: str, extra: str, user: str | None = None) -> ModuleType:
    """``importlib.import_module(module)``; when the module is not installed, an ImportError that
    names the extra, e.g. "gradzip.converge needs numpy: pip install 'gradzip[converge]'".
    ``user`` is the part of gradzip that needs it (default ``gradzip.<extra>``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise  # the module exists; something it imports is missing
        raise ImportError(f"{user or 'gradzip.' + extra} needs {distribution(module)}: "
                          f"pip install 'gradzip[{extra}]'", name=module) from None

"""Alignment (scoring) functions for :class:`attncore.Attention`: the registry.

Built-in names: ``dot``, ``scaled_dot``, ``bilinear`` (alias ``general``),
``mlp`` (aliases ``additive``, ``concat``).  More come from explicit
:func:`register` calls or from installed plugins publishing entry points in
the group ``attncore.alignments``::

    [project.entry-points."attncore.alignments"]
    cosine = "attncore_cosine:Cosine"

Precedence: explicit :func:`register` > built-in > entry point.  Plugins are
discovered on first use of the registry (never at ``import attncore``) and
imported only when their name is requested;
``ATTNCORE_DISABLE_PLUGIN_AUTOLOAD=1`` turns discovery off.

Functions
---------
register(name, obj=None, *, replace=False)
get(name)
create(name, **params)
available(details=False)
refresh()
"""
from ._base import Alignment
from ._registry import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    AlignmentConflictError,
    AlignmentLoadError,
    AlignmentNotFoundError,
    available,
    create,
    get,
    refresh,
    register,
)

__all__ = ["Alignment", "register", "get", "create", "available", "refresh",
           "AlignmentNotFoundError", "AlignmentConflictError", "AlignmentLoadError",
           "ENTRY_POINT_GROUP", "DISABLE_ENV"]

"""Where the segmented (pipelined) chains and trees live: this module only names them.

A chain or tree broadcast that forwards the whole vector makes every rank
wait for all n bytes before it passes on the first: depth x nβ. Cut into K
segments, a rank forwards segment k-1 while it receives segment k, so the
depth is paid once per segment. The algorithms that do this are plain
schedule generators, one module per family:

* :mod:`.chain` -- ``broadcast_chain_pipelined``;
* :mod:`.binary_tree` -- ``broadcast_binary_tree_segmented`` and
  ``reduce_binary_tree_segmented``, and the tick-by-tick tree pipelines
  (:func:`.binary_tree.together`);
* :mod:`.double_tree` -- ``broadcast``, ``reduce`` and ``allreduce_double_binary_tree``;
* :mod:`.pipelined` -- the pipelined rings (``allreduce_ring_pipelined``,
  ``reduce_scatter_ring_pipelined``) and the segment helpers all of them use;
* :mod:`.recursive_halving` -- ``reduce_rabenseifner``, the large-message
  reduce, which cuts no segments.

The names below are those modules' own, importable from here as well for
code written when they all lived in this one module.
"""

from __future__ import annotations

# Re-exported, not used here (so no __all__: the API docs list each name once, in its own module).
from .binary_tree import broadcast_binary_tree_segmented, reduce_binary_tree_segmented  # noqa: F401
from .chain import broadcast_chain_pipelined  # noqa: F401
from .double_tree import (  # noqa: F401
    allreduce_double_binary_tree,
    broadcast_double_binary_tree,
    double_tree,
    inorder_children,
    inorder_parent,
    reduce_double_binary_tree,
)
from .pipelined import reduce_scatter_ring_pipelined  # noqa: F401
from .recursive_halving import reduce_rabenseifner  # noqa: F401


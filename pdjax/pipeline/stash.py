"""Weight versions: per stage, exactly the versions of the weights a schedule still needs.

A version is a pytree of (immutable) device arrays, so keeping one costs memory only
while it differs from the newest. The store is told, up front, how many actions of the
schedule read each version (forwards, backwards, input- and weight-gradients); each read
counts down, and a version that is not the newest and has no reads left is dropped at
once, its buffers freed when the last reference goes. So a flush schedule never holds
more than one version, PipeDream's asynchronous 1F1B holds at most ``P - s`` at stage
``s``, and 2BW two.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdjax.errors import PipelineError
from pdjax.layers import PyTree

__all__ = ["WeightStore"]


class WeightStore:
    """The weight versions of one stage.

    Args:
      params: version 0 of the stage's parameters (the newest when a run starts).
      reads: per version number, how many schedule actions will read it.

    >>> store = WeightStore({"w": 1.0}, reads={0: 2, 1: 1})
    >>> store.read(0)["w"]
    1.0
    >>> store.push({"w": 0.9})  # an update: version 1; version 0 still has a read left
    1
    >>> store.alive()
    2
    >>> store.read(0)["w"]  # its last read: version 0 is dropped
    1.0
    >>> store.alive()
    1
    """

    def __init__(self, params: PyTree, reads: Mapping[int, int]) -> None:
        self._versions: dict[int, PyTree] = {0: params}
        self._reads = dict(reads)
        self.latest = 0
        self.peak_alive = 1

    def read(self, version: int) -> PyTree:
        """The weights of ``version``, for one of the reads announced at construction.

        Raises:
          PipelineError: if that version is not kept (never made, or all its announced
            reads are done): the schedule reads weights it did not stash.
        """
        if version not in self._versions:
            raise PipelineError(
                f"weight version {version} is not kept (alive: {sorted(self._versions)}); "
                "the schedule reads a version it did not stash"
            )
        params = self._versions[version]
        self._reads[version] = self._reads.get(version, 0) - 1
        self._collect()
        return params

    def reads_left(self, version: int) -> int:
        """How many announced reads of ``version`` are still to come."""
        return max(0, self._reads.get(version, 0))

    @property
    def newest(self) -> PyTree:
        """The newest version (what the next update starts from)."""
        return self._versions[self.latest]

    def push(self, params: PyTree) -> int:
        """Adds the next version (after an optimizer update); returns its number."""
        self.latest += 1
        self._versions[self.latest] = params
        self._collect()
        self.peak_alive = max(self.peak_alive, len(self._versions))
        return self.latest

    def alive(self) -> int:
        """How many distinct versions are held now."""
        return len(self._versions)

    def _collect(self) -> None:
        for v in list(self._versions):
            if v != self.latest and self._reads.get(v, 0) <= 0:
                del self._versions[v]

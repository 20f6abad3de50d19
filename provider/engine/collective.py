"""The engine's word for a failure of the group's wire. The engine owns it, so that it can tell such a failure
(the node cannot go on) from one job's, without knowing anything of the group (provider.group raises it)."""

from __future__ import annotations


class GroupLost(RuntimeError):
    """A rank is gone, stalled or out of step: the group cannot go on. Every rank exits for its supervisor."""


def collective_failure(e: BaseException) -> bool:
    """A failure of the group's wire (a peer gone, a connection lost), not of one job."""
    return isinstance(e, GroupLost) or (isinstance(e, RuntimeError) and str(e).startswith(("[ring]", "[jaccl]",
                                                                                            "[distributed]")))

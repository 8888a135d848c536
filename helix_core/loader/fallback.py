"""Routing without the Coordinator (pure; the client holds the lock): the servers a client has
learnt from its routes, and the choice among them while the Coordinator is unreachable — its
delivery server first, then its host's other local servers and the remote ones, the one with the
fewest of this client's outstanding requests, skipping those the request found dead."""

from __future__ import annotations

from helix_core.errors import ClusterError
from helix_core.wire.messages import Route

__all__ = ["KnownServers"]


class KnownServers:
    """What a client knows of the cluster's servers, and its own load on each in an outage."""

    def __init__(self):
        self.known: dict[str, tuple[str, str]] = {}  # server id -> (address, kind): our host's locals, remotes
        self.delivery: tuple[str, str] | None = None  # the last delivery server the Coordinator named
        self._load: dict[str, int] = {}  # server id -> this client's requests routed there in an outage
        self._owner: dict[int, str] = {}  # task id -> its server, for those
        self.routes = 0  # requests routed without the Coordinator

    def learn(self, exec_id: str, exec_address: str, exec_kind: str, delivery_id: str, delivery_address: str) -> None:
        """A route the Coordinator gave: remember both servers, and the delivery server."""
        self.known[exec_id] = (exec_address, exec_kind)
        self.known[delivery_id] = (delivery_address, "local")
        self.delivery = (delivery_id, delivery_address)

    def route(self, part, coordinator: str, host: str) -> Route:
        """A Route for ``part`` chosen here (``ClusterError`` when no known server is left)."""
        if self.delivery is None:
            raise ClusterError(f"lost the Coordinator at {coordinator} before it named a server")
        locals_ = [sid for sid, (_, kind) in self.known.items() if kind == "local"]  # all on our host
        ordered = [self.delivery[0]] + [sid for sid in locals_ if sid != self.delivery[0]]
        delivery = next((sid for sid in ordered if sid not in part.excluded), None)
        if delivery is None:
            raise ClusterError(
                f"the Coordinator at {coordinator} is unreachable and every DataServer this "
                f"client knows on host {host!r} failed: {sorted(part.excluded)}"
            )
        candidates = [delivery] + [sid for sid in self.known if sid != delivery and sid not in part.excluded]
        chosen = min(candidates, key=lambda sid: (self._load.get(sid, 0), sid != delivery))
        self.done(part.task_id)  # a resubmitted request leaves its old server
        self._owner[part.task_id] = chosen
        self._load[chosen] = self._load.get(chosen, 0) + 1
        self.routes += 1
        address, kind = self.known[chosen]
        return Route(chosen, address, kind, delivery, self.known[delivery][0], "coordinator-unreachable", 0.0)

    def done(self, task_id: int) -> None:
        """A request routed here completed (or was given up): its server's load drops."""
        owner = self._owner.pop(task_id, None)
        if owner is not None:
            self._load[owner] -= 1

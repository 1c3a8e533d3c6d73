"""The Ray Serve request router of the engine replicas: routing.Policy's decisions over the replica
set Ray keeps live.

Ray ships this module by value (cloudpickle) into every process that holds a handle to the
deployment, so it holds only the glue; the state is routing.py's Policy, imported by name at run
time, which the front end in the same process shares (to drain a replica, to read the loads).

Keyword arguments of a call that the router reads:
    replica     a replica id: the call goes to that replica only (metrics, slots, a prefix export)
    hashes      the prompt's block hashes (routing.block_hashes): the call is routed by the Policy
                and counted in the replica's load until it ends (a call without either: any replica)
    key         the caller's name for the request (Policy.routed says where it went)
and the one it writes: handover, the replica to fetch a longer cached prefix from.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


class PrefixRouter(RequestRouter):
    """routing.Policy as a Ray Serve RequestRouter (request_router_kwargs: deployment, routing,
    load_bound)."""

    def initialize_state(self, deployment: str = "engine", routing: str = "prefix", load_bound: int = 4,
                         **_: Any) -> None:
        from llamax.cluster import routing as _routing

        self._policy = _routing.policy(deployment, routing, load_bound)
        self._counted: dict[str, str | None] = {}  # internal request id -> the caller's key

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        kw = pending_request.kwargs
        target = kw.get("replica")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if "hashes" not in kw:  # a call that is not a generation: any replica
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        choice = self._policy.choose(list(by_id), kw["hashes"])
        if choice is None:
            return []
        if choice.handover is not None:
            kw["handover"] = choice.handover
        return [[by_id[choice.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        kw = pending_request.kwargs
        if kw.get("replica") is None and "hashes" in kw:
            key = kw.get("key")
            self._counted[pending_request.metadata.internal_request_id] = key
            self._policy.started(key, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self._counted:
            self._policy.ended(replica_id.unique_id, self._counted.pop(internal_request_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self._policy.set_replicas([r.replica_id.unique_id for r in replicas])
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._policy.dead(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

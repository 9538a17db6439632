"""The leader-follower messages cross a pipe as pickles: each comes back equal, and a follower's
registry mirrors the leader's worker list sent as one."""

from __future__ import annotations

import pickle

import pytest
from gwtest import gateway_config

from atomesh.cluster.messages import (
    DrainReport,
    IndexBatch,
    MetricsQuery,
    MetricsReply,
    Ready,
    Stop,
    SyncWorkers,
    WorkerInfo,
)
from atomesh.cluster.mirror import describe, mirror, mirrored_workers
from atomesh.gateway import Gateway
from atomesh.workers.worker import Worker, WorkerState

pytestmark = pytest.mark.timeout(30)

INFO = WorkerInfo(
    url="http://127.0.0.1:1",
    role="regular",
    bootstrap_port=None,
    state="ready",
    models=("m",),
    kv_transfer_info={},
    server_info={"a": 1},
    engine_load=3,
)


@pytest.mark.parametrize(
    "message",
    [
        SyncWorkers((INFO,), 7),
        MetricsQuery(1),
        Stop(),
        Ready(),
        MetricsReply(1, {"mesh_x": {("a",): 1.0}}),
        DrainReport({"http://127.0.0.1:1": 2}, 7),
        IndexBatch((("regular/prefix_index", ("http://127.0.0.1:1", [1, 2])), ("regular/kv_placements", b"\x94"))),
    ],
)
def test_messages_survive_the_pipe(message: object) -> None:
    assert pickle.loads(pickle.dumps(message)) == message


async def test_a_follower_registry_mirrors_the_leader_list() -> None:
    leader, follower = Gateway(gateway_config()), Gateway(gateway_config())
    w = Worker(url="http://127.0.0.1:1", models=("m",), engine_load=5, foreign_load=2)
    leader.registry.add(w)
    assert mirrored_workers(leader) == ()  # pending workers take no traffic anywhere
    leader.registry.set_state(w, WorkerState.READY)
    mirror(follower, mirrored_workers(leader))
    copy = follower.registry.by_url(w.url)
    assert copy is not None and copy.state is WorkerState.READY and describe(copy) == describe(w)
    assert (copy.engine_load, copy.foreign_load) == (5, 2)  # kv_aware's followers weigh the foreign load
    mirror(follower, ())  # gone from the leader: drained, then removed
    assert follower.registry.by_url(w.url) is None and copy.state is WorkerState.REMOVED

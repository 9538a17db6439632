"""Several gateway processes on one port (`--processes N`): one leader, N-1 followers.

The kernel spreads incoming connections over every process listening with SO_REUSEPORT, so each one
serves inference requests on its own core. State has one owner:

- The **leader** is the gateway as it runs alone: worker registry and lifecycle, health checks, load
  polling, the admin API and the metrics port. It sends each follower the workers it knows (with
  their state and engine-reported load) whenever that changes, and at least once a second.
- A **follower** mirrors that worker list into a registry of its own and runs the request path on
  it: front door, placement, router, backends, admission (each process gets 1/N of the admission
  limits). Every request that is not a plain inference request (admin, health, models, metrics...)
  is read whole by its front door and passed to the leader's private loopback port, so there is one
  truth for workers and one answer for every other route.
- **Metrics stay whole**: at scrape time the leader asks every follower for its request-path values
  and adds them to its own (gauges and counters summed, histograms bucket by bucket); series that
  describe the registry come from the leader alone.
- **Draining stays sound**: followers report their in-flight requests on draining workers whenever
  they change, and the leader removes a worker only when no process has a request on it.
- **Placement**: round_robin, random, power_of_two and least_load balance each process's share of
  the traffic (engine-reported loads reach every process); prefix_hash is the same function in every
  process. cache_aware keeps one index per process and every process sends the placements it records
  to the others (batched once per event-loop turn, through the leader), so each index learns from all
  the traffic, a few hundred microseconds late at most. kv_aware's processes each follow the engines'
  KV events and send each other what they have in flight and the blocks they just placed, as its
  replicas do over `--kv-sync-*`. Which state a policy shares it says itself (`Policy.replicas`).

Modules, by role (each imports only those above it in this list, and none imports the package itself):

- `messages`: what the processes say to each other, one frozen dataclass per message;
- `channel`: one end of a pipe, read from the event loop;
- `mirror`: the leader's worker list as messages, and a follower's registry made to match it;
- `index`: policy state replicated between processes (`Policy.replicas`);
- `follower`: a follower process (its server, its side of the pipe, its entry point);
- `leader`: the leader's supervision of its followers (spawn, restart, sync, metrics, drains, stop).
"""

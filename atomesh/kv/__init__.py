"""KV-aware placement's parts, one module each (`atomesh.policies.kv_aware` wires them):

- `events`: subscriptions to the engines' KV events (vLLM's ZMQ format), one task per worker;
- `index`: the global index those events build (block-chain key -> workers holding it);
- `tokens`: the engine's token ids for a request, computed in the gateway (prefix_hash uses it too),
  and the fetch of a worker's tokenizer when none is configured;
- `sync`: what gateway replicas (`--kv-sync-*`) and a gateway's processes (`--processes`) tell each
  other of their in-flight placements;
- `scoring`: the decision's scorers (overlap, load), rules (new prompt, relief) and picker.

Within the package `events`, `tokens` and `scoring` import `index`, and `scoring` imports `sync`;
none imports the package itself. The layer sits above `workers` (a subscription follows the registry)
and below `policies`.
"""

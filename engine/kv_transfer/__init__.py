"""KV transfer between a prefill engine (kv_producer) and a decode engine (kv_consumer), ATOM's push model.

Modules: ``layout`` (regions, coalescing into writes), ``mooncake`` (the Mooncake agent, the only
importer of ``mooncake``), ``connector`` (the handshake: KVProducer / KVConsumer), ``wire`` (the
handshake frames), ``params`` (``kv_transfer_params``), ``errors``. Nothing here knows the
scheduler or the block manager: the engine passes in the agent, its regions and a release callback.

Wiring, once at start-up (both roles)::

    from engine.kv_transfer import MooncakeAgent, regions_from_kv_caches
    agent = MooncakeAgent(host)                       # host: this machine's address peers can reach
    regions = regions_from_kv_caches(runner.kv_caches, indexer_caches)
    agent.register(regions)                           # both sides must list regions alike

Prefill (kv_producer)::

    producer = KVProducer(agent, regions, host=host, handshake_port=cfg.handshake_port)
    await producer.start()
    params = producer.offer(seq.block_table, first_token_id, on_release=lambda reason: free(seq))
    answer["kv_transfer_params"] = params.to_dict()   # blocks stay pinned until on_release runs

Decode (kv_consumer)::

    consumer = KVConsumer(agent, regions)
    params = KVTransferParams.from_dict(request.kv_transfer_params)   # 400 on bad params
    allocate len(params.remote_block_ids) blocks -> dst_ids   # SKIP (-1) for blocks decode already holds
    try:
        await consumer.pull(params, dst_ids)
    except KVTransferError as err:                    # fail the request with err (502, OpenAI-shaped)
        free dst_ids, after a grace period if err.dst_may_be_written (prefill may still be writing)
    except asyncio.CancelledError:                    # the client left: re-raise after freeing dst_ids,
        after a grace period if consumer.dst_may_be_written_if_cancelled(params) (a direct write may still land)
    ...then decode from params.first_token_id

Shutdown: ``await producer.close()`` (releases what is pending), then ``agent.close()``.
"""

from engine.kv_transfer.agent import TransferAgent
from engine.kv_transfer.connector import KVConsumer, KVProducer, ProducerStats, ReleaseReason
from engine.kv_transfer.errors import KVTransferBusyError, KVTransferError, TransferEngineError
from engine.kv_transfer.layout import SKIP, Region, WriteOp, block_region, plan_writes, regions_from_kv_caches
from engine.kv_transfer.mooncake import MooncakeAgent
from engine.kv_transfer.params import KVTransferParams, KVTransferParamsError

__all__ = [
    "SKIP",
    "KVConsumer",
    "KVProducer",
    "KVTransferBusyError",
    "KVTransferError",
    "KVTransferParams",
    "KVTransferParamsError",
    "MooncakeAgent",
    "ProducerStats",
    "Region",
    "ReleaseReason",
    "TransferAgent",
    "TransferEngineError",
    "WriteOp",
    "block_region",
    "plan_writes",
    "regions_from_kv_caches",
]

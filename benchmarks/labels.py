"""The benchmark's names of the systems, in the order tables and figures show them."""

LABELS = {
    "torch_save": "torch.save (sync)",
    "torch_dist_sync": "mcore torch_dist (sync)",
    "torch_dist_async": "mcore torch_dist (async)",
    "dcp_sync": "DCP save (sync)",
    "dcp_async": "DCP async_save (staged)",
    "engine_sync": "this engine (sync)",
    "engine_lazy": "this engine (lazy async)",
}
ORDER = list(LABELS)
ASYNC_PEERS = ("torch_dist_async", "dcp_async")
PEERS = ("torch_save", "torch_dist_sync", "torch_dist_async", "dcp_sync", "dcp_async")

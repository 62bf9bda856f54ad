"""Fixtures shared by test modules."""
import pytest

from s3_store import s3_server  # noqa: F401  one SeaweedFS for the whole run, started by the first test that asks


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """A gloo world of one process in this test process (for stock megatron-core calls and in-process models),
    with cpu_shim installed for the module's tests and removed after if it was not before."""
    import torch.distributed as dist
    from megatron.training import cpu_shim
    was = cpu_shim.installed()
    cpu_shim.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('store')}/s", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
    if not was:
        cpu_shim.uninstall()

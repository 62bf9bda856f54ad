"""Fixtures shared by test modules."""
import subprocess

import pytest

from s3_store import s3, s3_server  # noqa: F401  one SeaweedFS for the whole run, started by the first test that asks


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


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a new tmpfs of `size` ("2m") under tmp_path, to fill up or remount; the test is skipped
    where mounting is not allowed (it needs root); unmounted after the test."""
    mounted = []

    def mount(size: str):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)])

"""The S3 backend's retries through the engine, against a real SeaweedFS behind the fault-injecting proxy of
tests/s3_faults.py: throttled (503 SlowDown) parts and PUTs, a connection reset before a part's reply and in the
middle of a ranged GET's body, and throttling that outlasts the retry budget."""
import collections
import re

import pytest

from datastates import CheckpointError, paths, tracker
from datastates.storage import s3
from s3_faults import FaultProxy
from test_s3_storage import PART_SLOTS, assert_same, engines, keys, state

BIG = 12 << 20  # two parts of 8 MiB slots; under one 16 MiB ranged GET


@pytest.fixture
def proxy(s3_server, monkeypatch):
    """The store's variables in this process's environment, its endpoint replaced by a fault proxy's."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(k, raising=False)
    p = FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)  # a new endpoint: a new boto3 client (s3.client is cached)
    yield p
    p.close()


@pytest.fixture
def root(s3_server):
    return f"s3://{s3_server.create_bucket()}/run"


def attempts(proxy, kind):
    """How many times each request of `kind` was sent (a part: its upload id and number)."""
    return collections.Counter(proxy.seen(kind))


def test_throttled_parts_and_puts_are_retried_and_the_checkpoint_loads_bit_exact(proxy, root):
    proxy.inject("UploadPart", "slow_down", times=2)
    proxy.inject("PutObject", "slow_down", times=2)  # the manifest's first two attempts (a bytes body: no Expect)
    (eng,) = engines(root, budget=PART_SLOTS)
    with eng:
        want = state(1, BIG)
        eng.save(want, paths.checkpoint_dir(root, 1)).wait()
        assert tracker.read_latest(root) == 1
        assert_same(eng.load(root), want)
    parts, puts = attempts(proxy, "UploadPart"), attempts(proxy, "PutObject")
    assert len(parts) == 2 and sum(parts.values()) == 2 + 2
    assert len(puts) == 3 and sum(puts.values()) == 3 + 2  # manifest, index, tracker


def test_a_reset_inside_a_ranged_get_resumes_from_the_first_missing_byte(proxy, root):
    (eng,) = engines(root, budget=PART_SLOTS)
    with eng:
        want = state(2, BIG)
        eng.save(want, paths.checkpoint_dir(root, 2)).wait()
        received = 3 * s3.BODY_READ  # whole pieces of the body: what the reader holds when the reset comes
        proxy.inject("RangedGet", "reset_body", after=received)
        assert_same(eng.load(root), want)
    gets = [(rng, fault) for kind, _, rng, fault in proxy.requests if kind == "RangedGet"]
    (broken,) = [rng for rng, fault in gets if fault == "reset_body"]
    first, last = map(int, broken[len("bytes="):].split("-"))
    assert f"bytes={first + received}-{last}" in [rng for rng, _ in gets]  # only the missing bytes, asked again


def test_a_part_whose_connection_resets_before_the_reply_is_sent_again(proxy, root):
    proxy.inject("UploadPart", "reset")
    (eng,) = engines(root, budget=PART_SLOTS)
    with eng:
        want = state(3, BIG)
        eng.save(want, paths.checkpoint_dir(root, 3)).wait()
        assert_same(eng.load(root), want)
    parts = attempts(proxy, "UploadPart")
    assert len(parts) == 2 and sorted(parts.values()) == [1, 2]


def test_throttling_beyond_the_retry_budget_fails_the_save_naming_the_path_and_loses_nothing_published(
        proxy, root, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    (eng,) = engines(root, budget=PART_SLOTS)
    with eng:
        eng.save(state(1), paths.checkpoint_dir(root, 1)).wait()
        proxy.inject("UploadPart", "slow_down", times=1000)
        failing = paths.checkpoint_dir(root, 2)
        with pytest.raises(CheckpointError, match=re.escape(paths.join(failing, paths.data_file(0))) + ".*SlowDown"):
            eng.save(state(2, BIG), failing).wait()
        parts = attempts(proxy, "UploadPart")
        # AWS_MAX_ATTEMPTS attempts of each part (one retry after one backoff), each throttled, then given up
        assert parts and set(parts.values()) == {2}
        answers = [fault for kind, _, _, fault in proxy.requests if kind == "UploadPart"]
        assert answers == ["slow_down"] * sum(parts.values())
        assert tracker.read_latest(root) == 1
        assert_same(eng.load(root), state(1))
    assert keys(s3_server, failing) == ([], [])  # the failed upload aborted, its prefix removed

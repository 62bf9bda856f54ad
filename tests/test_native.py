"""Tests of the native I/O module datastates._native (crc32c, File, IOPool) against real files."""

import errno
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from datastates import _native as native
from datastates import aligned_empty  # O_DIRECT's alignment, so the direct path is exercised
from late_copies import copy_thread_held

MiB = 1 << 20
ALIGN = 4096


def random_tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    t = aligned_empty(nbytes)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


def crc_of(t: torch.Tensor) -> int:
    return native.crc32c(t.numpy())


def accepts_o_direct(directory) -> bool:
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = aligned_empty(ALIGN)
        return os.pwritev(fd, [memoryview(buf.numpy())], 0) == ALIGN
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(probe)


@pytest.fixture
def small_tmpfs(tmpfs):
    """A 4 MiB tmpfs, to run out of space on."""
    return tmpfs("4m")


# ------------------------------------------------------------------------------------------- crc32c


def test_crc32c_known_vectors():
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0
    assert native.crc32c(b"", 0x1234) == 0x1234
    assert native.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert native.crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of ones
    assert native._crc32c_sw(b"123456789") == 0xE3069283


def test_crc32c_continuation():
    data = os.urandom(300_000)
    for cut in (0, 1, 4095, 100_000, len(data)):
        a, b = data[:cut], data[cut:]
        assert native.crc32c(b, native.crc32c(a)) == native.crc32c(data)


def test_crc32c_hardware_matches_table():
    rng = random.Random(1)
    data = os.urandom(200_000)
    # Odd lengths and start offsets, across the 3x256 and 3x8192 interleaved block sizes of the hardware path.
    lengths = [0, 1, 3, 7, 9, 767, 768, 769, 24575, 24576, 24577, 49153] + [rng.randrange(1, 199_000) | 1 for _ in range(40)]
    for n in lengths:
        start = rng.randrange(0, len(data) - n)
        view = memoryview(data)[start : start + n]
        seed = rng.randrange(0, 1 << 32)
        assert native.crc32c(view, seed) == native._crc32c_sw(view, seed), (n, start)


def test_crc32c_accepts_buffers_and_raw_pointers():
    data = os.urandom(100_001)
    want = native.crc32c(data)
    assert native.crc32c(bytearray(data)) == want
    assert native.crc32c(memoryview(data)) == want
    assert native.crc32c(np.frombuffer(data, dtype=np.uint8)) == want
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert native.crc32c_ptr(t.data_ptr(), t.numel()) == want
    assert native.crc32c_ptr(t.data_ptr() + 10, 5, native.crc32c(data[:10])) == native.crc32c(data[:15])
    with pytest.raises(TypeError, match="a bytes-like object is required, not 'str'"):
        native.crc32c("not a buffer")


# ------------------------------------------------------------------------------------------- File


def test_file_direct_matches_file_system(tmp_path):
    with_direct = native.File(tmp_path / "a", "w")
    assert with_direct.direct == accepts_o_direct(tmp_path)
    assert with_direct.path == str(tmp_path / "a")
    assert not native.File(tmp_path / "b", "w", direct="off").direct
    if accepts_o_direct(tmp_path):
        assert native.File(tmp_path / "c", "w", direct="on").direct
    with pytest.raises(ValueError, match="File direct must be 'auto', 'on' or 'off', not 'sometimes'"):
        native.File(tmp_path / "d", "w", direct="sometimes")
    with pytest.raises(ValueError, match="File mode must be 'w' or 'r', not 'x'"):
        native.File(tmp_path / "d", "x")


def test_file_sync_write_read_truncate(tmp_path):
    f = native.File(tmp_path / "f", "w", preallocate=1 * MiB)
    assert f.size() == 1 * MiB
    f.write(3, b"hello")
    f.write(8, bytearray(b" world"))
    f.truncate(14)
    f.fsync()
    assert f.size() == 14
    f.close()
    f.close()  # idempotent
    with pytest.raises(OSError) as e:
        f.fsync()
    assert e.value.errno == errno.EBADF
    assert (tmp_path / "f").read_bytes() == b"\0\0\0hello world"
    r = native.File(tmp_path / "f", "r")
    assert r.read(3, 11) == b"hello world"
    assert r.read(14, 0) == b""


def test_open_missing_directory_names_path(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "file"
    with pytest.raises(FileNotFoundError) as e:
        native.File(path, "w")
    assert e.value.errno == errno.ENOENT
    assert f"open for writing '{path}'" in str(e.value)
    with pytest.raises(FileNotFoundError, match="open for reading"):
        native.File(path, "r")


def test_open_permission_denied_names_path(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root bypasses directory permissions")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(PermissionError) as e:
            native.File(locked / "x", "w")
        assert e.value.errno == errno.EACCES
        assert str(locked / "x") in str(e.value)
    finally:
        locked.chmod(0o700)


def test_read_past_eof_names_path(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 5000)
    f = native.File(path, "r")
    with pytest.raises(OSError) as e:
        f.read(4000, 2000)
    assert f"short read '{path}': wanted 2000 bytes at offset 4000, got 1000" in str(e.value)

    pool = native.IOPool(2)
    dst = aligned_empty(3 * ALIGN)
    ticket = pool.submit_read(f, dst.data_ptr(), 3 * ALIGN, 0)
    with pytest.raises(OSError) as e:
        pool.wait(ticket)
    assert f"short read '{path}'" in str(e.value) and "got 5000" in str(e.value)
    pool.close()


def test_full_disk_preallocate_and_pool_write(small_tmpfs):
    path = small_tmpfs / "big"
    with pytest.raises(OSError) as e:
        native.File(path, "w", preallocate=8 * MiB)
    assert e.value.errno == errno.ENOSPC
    assert str(path) in str(e.value)
    assert os.statvfs(small_tmpfs).f_bfree * os.statvfs(small_tmpfs).f_frsize > 3 * MiB  # space handed back

    f = native.File(path, "w")
    pool = native.IOPool(2)
    data = random_tensor(8 * MiB)
    ticket = pool.submit_write(f, data.data_ptr(), data.numel(), 0)
    with pytest.raises(OSError) as e:
        pool.wait(ticket)
    assert e.value.errno == errno.ENOSPC
    assert f"pwrite '{path}' at offset 0 ({8 * MiB} bytes)" in str(e.value)
    f.close()
    pool.close()


# ------------------------------------------------------------------------------------------- IOPool


def test_round_trip_20mib_aligned_and_unaligned_pieces(tmp_path):
    n = 20 * MiB
    src = random_tensor(n, seed=7)
    # Piece boundaries: aligned ones, unaligned ones, one piece spanning several 8 MiB chunks.
    cuts = [0, 3 * ALIGN, 3 * ALIGN + 777, 5 * MiB + 1, 5 * MiB + 4097, 19 * MiB, n]
    pieces = list(zip(cuts, cuts[1:]))
    path = tmp_path / "round_trip"
    f = native.File(path, "w", preallocate=n)

    pool = native.IOPool(3)
    written0 = pool.bytes_written
    tickets = []
    for lo, hi in pieces:
        # Segments relative to the piece: the whole piece and an odd-sized inner one.
        segs = [(0, hi - lo), ((hi - lo) // 3, (hi - lo) // 2)]
        tickets.append((lo, hi, segs, pool.submit_write(f, src.data_ptr() + lo, hi - lo, lo, segs)))
    for lo, hi, segs, ticket in tickets:
        assert pool.wait(ticket) == [crc_of(src[lo + s : lo + s + k]) for s, k in segs]
    f.fsync()
    f.close()
    assert pool.bytes_written - written0 == n
    assert pool.writes == len(pieces)
    assert path.stat().st_size == n
    assert native.crc32c(path.read_bytes()) == crc_of(src)

    r = native.File(path, "r")
    assert r.direct == accepts_o_direct(tmp_path)
    dst = aligned_empty(n)
    dst.zero_()
    # Read back in different pieces, segments spanning the 8 MiB chunk boundaries.
    read_cuts = [0, 1, 8 * MiB - 5, 8 * MiB + ALIGN, n]
    tickets = []
    for lo, hi in zip(read_cuts, read_cuts[1:]):
        segs = [(0, hi - lo), (0, 0), (max(0, hi - lo - 9 * MiB), min(hi - lo, 9 * MiB))]
        tickets.append((lo, hi, segs, pool.submit_read(r, dst.data_ptr() + lo, hi - lo, lo, segs)))
    for lo, hi, segs, ticket in tickets:
        assert pool.wait(ticket) == [crc_of(src[lo + s : lo + s + k]) for s, k in segs]
    assert torch.equal(src, dst)
    assert pool.bytes_read == n
    assert pool.reads == len(read_cuts) - 1
    pool.close()
    pool.close()  # idempotent


def test_write_from_unaligned_addresses_goes_direct_through_a_copy(tmp_path):
    """Bytes at an address whose offset within a block differs from the file's (a safetensors tensor after an
    odd-sized one) are written right, and with O_DIRECT: only the pages of the unaligned ends are left in the
    page cache, where the same write with O_DIRECT off leaves every page."""
    if not accepts_o_direct(tmp_path):
        pytest.skip("this file system does not accept O_DIRECT")
    n = native.CHUNK_BYTES + 5 * MiB + 777  # a chunk, then a piece longer than one bounce copy, and a short tail
    src = random_tensor(n + 100, seed=13)[100:]  # 100 bytes past a block boundary
    at = 3 * ALIGN + 300  # 300 past one in the file
    pool = native.IOPool(2)
    for direct in ("auto", "off"):
        f = native.File(tmp_path / direct, "w", direct)
        assert pool.wait(pool.submit_write(f, src.data_ptr(), n, at, [(0, n)])) == [crc_of(src)]
        assert f.direct == (direct == "auto")  # O_DIRECT stayed in use
        f.fsync()
        f.close()
    pool.close()
    # the pool writes it in two chunks: a page at its start, one where the chunks meet, one at its end
    assert resident_pages(tmp_path / "auto") <= 3
    assert resident_pages(tmp_path / "off") >= -(-(at + n) // ALIGN) - 3
    for direct in ("auto", "off"):
        assert (tmp_path / direct).read_bytes()[at:] == src.numpy().tobytes(), direct


def test_single_large_request_crcs_span_chunks(tmp_path):
    n = 3 * native.CHUNK_BYTES + 12345
    src = random_tensor(n, seed=3)
    segs = [(0, n), (5, native.CHUNK_BYTES * 2), (native.CHUNK_BYTES - 3, 10), (n - 1, 1), (n, 0)]
    pool = native.IOPool(4)
    f = native.File(tmp_path / "big", "w")
    assert pool.wait(pool.submit_write(f, src.data_ptr(), n, ALIGN, segs)) == [
        crc_of(src[s : s + k]) for s, k in segs
    ]
    assert f.size() == ALIGN + n
    dst = aligned_empty(n)
    assert pool.wait(pool.submit_read(native.File(tmp_path / "big", "r"), dst.data_ptr(), n, ALIGN, segs[:1])) == [
        crc_of(src)
    ]
    assert torch.equal(src, dst)
    pool.close()


def test_submit_from_several_threads_and_wait_all(tmp_path):
    pool = native.IOPool(2)
    f = native.File(tmp_path / "shared", "w")
    src = random_tensor(8 * 3 * 100_003, seed=5)
    errors = []

    def writer(k):
        try:
            for i in range(3):
                lo = (k * 3 + i) * 100_003
                pool.submit_write(f, src.data_ptr() + lo, 100_003, lo)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.wait_all()
    assert not errors
    assert pool.writes == 24 and pool.bytes_written == src.numel()
    assert native.crc32c((tmp_path / "shared").read_bytes()) == crc_of(src)
    pool.close()


def test_pool_errors(tmp_path):
    pool = native.IOPool(1)
    f = native.File(tmp_path / "e", "w")
    buf = aligned_empty(ALIGN)
    with pytest.raises(ValueError, match="outside"):
        pool.submit_write(f, buf.data_ptr(), ALIGN, 0, [(100, ALIGN)])
    ticket = pool.submit_write(f, buf.data_ptr(), ALIGN, 0)
    assert pool.wait(ticket) == []
    with pytest.raises(ValueError, match="unknown ticket"):
        pool.wait(ticket)  # each ticket is waited once

    # wait_all reports the first failed ticket not yet waited: here a read from a write-only file.
    pool.submit_write(f, buf.data_ptr(), ALIGN, 0)
    pool.submit_read(f, buf.data_ptr(), ALIGN, 0)
    with pytest.raises(OSError) as e:
        pool.wait_all()
    assert e.value.errno == errno.EBADF and f"pread '{tmp_path / 'e'}'" in str(e.value)
    pool.wait_all()  # already reported

    # I/O on a closed File fails in the worker with EBADF, reported by wait().
    f.close()
    with pytest.raises(OSError) as e:
        pool.wait(pool.submit_write(f, buf.data_ptr(), ALIGN, 0))
    assert e.value.errno == errno.EBADF

    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit_write(f, buf.data_ptr(), ALIGN, 0)
    with pytest.raises(ValueError, match="IOPool needs at least one thread"):
        native.IOPool(0)


def resident_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore of a private mapping of it)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)


def test_stream_file_reads_right_bytes_and_leaves_no_pages_cached(tmp_path):
    """A stream file's requests, many at once on a 4-thread pool, each come back whole and checksummed; the
    pages they read are dropped from the page cache (a plain file's stay), so a load leaves no trace there."""
    n = 4 * native.CHUNK_BYTES + 777
    src = random_tensor(n, seed=11)
    for name in ("stream", "plain"):
        with open(tmp_path / name, "wb") as fh:
            fh.write(src.numpy().tobytes())
            fh.flush()
            os.fsync(fh.fileno())
    # Pages just written can be dropped only once the file system lets go of them: wait for that, then fill
    # the page cache by reading, as a load's stream does.
    deadline = time.monotonic() + 20
    for name in ("stream", "plain"):
        fd = os.open(tmp_path / name, os.O_RDONLY)
        while os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED) is None and resident_pages(tmp_path / name):
            if time.monotonic() > deadline:
                pytest.skip("the file system does not drop the pages of a file from its page cache")
            time.sleep(0.2)
        os.pread(fd, n, 0)
        os.close(fd)
    pages = resident_pages(tmp_path / "stream")
    assert pages == resident_pages(tmp_path / "plain") == -(-n // ALIGN)
    pool = native.IOPool(4)
    dst = {name: aligned_empty(n) for name in ("stream", "plain")}
    pieces = [(k * 1_000_003, min(1_000_003, n - k * 1_000_003)) for k in range(-(-n // 1_000_003))]
    tickets = []
    for name in ("stream", "plain"):
        f = native.File(tmp_path / name, "r", "off", stream=name == "stream")
        assert f.stream == (name == "stream")
        tickets += [(name, lo, k, pool.submit_read(f, dst[name].data_ptr() + lo, k, lo, [(0, k)]))
                    for lo, k in pieces]
    for name, lo, k, ticket in tickets:
        assert pool.wait(ticket) == [crc_of(src[lo:lo + k])], (name, lo)
    pool.close()
    for name in ("stream", "plain"):
        assert torch.equal(dst[name], src), name
    assert resident_pages(tmp_path / "stream") == 0
    # the plain file's pages stay (memory pressure from elsewhere may take a few: most is the contrast that counts)
    assert resident_pages(tmp_path / "plain") > pages // 2


def test_stream_read_of_a_tmpfs_file_keeps_it(tmp_path):
    """The memory tier's files live in tmpfs, where the page cache is the only copy: dropping pages behind a
    stream read must leave them there."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/datastates_test_{os.getpid()}"
    src = random_tensor(3 * native.CHUNK_BYTES + 5, seed=12)
    try:
        with open(path, "wb") as fh:
            fh.write(src.numpy().tobytes())
        pages = resident_pages(path)
        pool = native.IOPool(2)
        dst = aligned_empty(src.numel())
        f = native.File(path, "r", "off", stream=True)
        assert pool.wait(pool.submit_read(f, dst.data_ptr(), src.numel(), 0, [(0, src.numel())])) == [crc_of(src)]
        pool.close()
        assert torch.equal(dst, src)
        assert resident_pages(path) == pages
        with open(path, "rb") as fh:
            assert fh.read() == src.numpy().tobytes()
    finally:
        os.unlink(path)


def test_copy_pool_takes_a_queued_copy_before_a_checksum():
    """One thread busy with a 64 MiB copy; then a checksum of its first KiB and a second copy over that KiB are
    queued: the second copy runs first (the fence waits for copies only), so the checksum reads its bytes."""
    pool = native.CopyPool(1)
    try:
        src, ones = random_tensor(64 * MiB, seed=3), torch.full((1024,), 0xFF, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        first, second = native.CopyBatch(), native.CopyBatch()
        pool.copy(first, dst.data_ptr(), src.data_ptr(), src.numel())
        sums = pool.checksum(first, dst.data_ptr(), [(0, 1024)])
        pool.copy(second, dst.data_ptr(), ones.data_ptr(), 1024)
        assert sums.wait() == [native.crc32c(b"\xff" * 1024)]
        second.wait()
    finally:
        pool.close()


def test_copy_pool_checksums_what_it_copied_once_it_landed():
    """Ranges across pieces (4 MiB), within one, empty, overlapping: each crc equals the source's, computed after
    the copies it follows (a checksum queued before they land would read zeros)."""
    pool = native.CopyPool(3)
    try:
        src = random_tensor(21 * MiB, seed=7)
        dst = torch.zeros_like(src)
        batch = native.CopyBatch()
        for off in range(0, src.numel(), 5 * MiB):  # several copies into the one batch
            n = min(5 * MiB, src.numel() - off)
            pool.copy(batch, dst.data_ptr() + off, src.data_ptr() + off, n)
        ranges = [(0, 0), (3, 5), (MiB - 1, 9 * MiB + 2), (12 * MiB, 9 * MiB), (4 * MiB, 4 * MiB), (0, 21 * MiB)]
        got = pool.checksum(batch, dst.data_ptr(), ranges).wait()
        assert got == [native.crc32c(src[a:a + n].numpy()) for a, n in ranges]
        assert pool.checksum(None, 0, []).wait() == []
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.checksum(None, dst.data_ptr(), [(0, 1)])


def test_copy_pool_runs_queued_copies_on_a_waiting_caller():
    """The pool's only thread held: the caller's run_copies() lands the copies queued meanwhile, every piece on
    the caller's own thread, and leaves the held checksum to the pool (the fence's caller lends its core to the
    copies, never to the writers' side)."""
    pool = native.CopyPool(1)
    src = random_tensor(8 * MiB + 5, seed=12)
    dst, batch = torch.zeros_like(src), native.CopyBatch()
    try:
        with copy_thread_held(pool) as holding:
            pool.copy(batch, dst.data_ptr(), src.data_ptr(), src.numel())
            assert pool.copies_queued()
            assert pool.run_copies() == 3  # 4 + 4 MiB + 5 bytes, all on this thread
            assert batch.done() and not pool.copies_queued() and holding()  # done while the pool's thread is held
            assert torch.equal(dst, src)
    finally:
        pool.close()

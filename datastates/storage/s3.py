"""The S3 backend: AWS S3 and the stores that speak its API (SeaweedFS, MinIO, Ceph RGW; msc:// profiles of an S3
provider through `msc.py`), on boto3's low-level client (docs/object-storage.md).

An object store has no rename, no directories and no fsync; the contract (`base`) maps onto it thus:
- a checkpoint is a key prefix and is written in place: `stage` returns the final prefix itself, after deleting
  the marker (a checkpoint's index, as the policy names it) an earlier save of the same iteration left there
  (that one is invisible from then on);
- a rank's data file is one multipart upload whose parts are the submitted buffers themselves when they are
  S3-sized (a staging slot of 5 MiB or more: no copy); smaller submits are copied into a part buffer (at most one
  copy, at most `2 * upload threads` part buffers alive);
- publication (`save_root`) is the index's PUT (a prefix without it is invisible to every reader; `commit` has
  nothing left to do), then retention (`retire` deletes a checkpoint's marker first), then the tracker's PUT; a
  PUT is durable once acknowledged and visible to every later read (S3's read-after-write consistency);
- reads are ranged GETs in parallel, straight into the buffer they fill; a reset connection resumes the range
  where it broke.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import io
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from .. import _native
from .. import paths
from ..errors import CheckpointError
from .base import DataSink, DataSource, Options, Stat, Storage

PART_MIN = 5 << 20  # S3's smallest part, but for the last one
MAX_PARTS = 10_000
PART_BYTES = 16 << 20  # a part coalesced from small submits (larger when a file would need more than MAX_PARTS)
DIRECT_PART_MAX = 64 << 20  # a large submit goes up in parts of at most this (uploaded in parallel)
GET_BYTES = 16 << 20  # one ranged GET
BODY_READ = 1 << 20  # a GET's body is read in pieces of this: a broken body loses the piece it was reading only
READ_RETRIES = 5  # a broken GET resumes at most this often, with doubling sleeps
DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys

log = logging.getLogger(__name__)


@functools.cache
def boto_errors():
    """The exceptions boto3 and urllib3 raise for a failed request, and those of a broken response stream."""
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux
    request = (bx.ClientError, bx.BotoCoreError)
    stream = (bx.ResponseStreamingError, bx.ReadTimeoutError, ux.ProtocolError, ux.ReadTimeoutError, ConnectionError,
              TimeoutError)
    return request, stream


def as_oserror(e: Exception, url: str) -> OSError:
    """A boto3 failure as the OSError the engine reports, naming `url` and what to check."""
    from botocore import exceptions as bx
    if isinstance(e, bx.ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return OSError(errno.ENXIO, f"the bucket of {url} does not exist", url)
        if code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
            return FileNotFoundError(errno.ENOENT, "no such object", url)
        if status == 403:
            return PermissionError(errno.EACCES, f"access denied to {url} ({code}): check AWS_ACCESS_KEY_ID, "
                                                 f"AWS_SECRET_ACCESS_KEY or AWS_PROFILE", url)
        return OSError(errno.EIO, f"{url}: {code or status}: {e.response.get('Error', {}).get('Message', e)}", url)
    if isinstance(e, bx.NoCredentialsError):
        return PermissionError(errno.EACCES, f"no credentials for {url}: set AWS_ACCESS_KEY_ID and "
                                             f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE", url)
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return ConnectionRefusedError(errno.ECONNREFUSED, f"cannot reach the S3 endpoint for {url}: {e}", url)
    return OSError(errno.EIO, f"{url}: {type(e).__name__}: {e}", url)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def memory_of(buffer, nbytes: int) -> memoryview:
    """The first `nbytes` of a host tensor's memory as a writable byte view, without a copy."""
    return memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")


def segment_crcs(view: memoryview, segments: list[tuple[int, int]]) -> list[int]:
    return [_native.crc32c(view[start:start + n]) for start, n in segments]


class PartBody(io.RawIOBase):
    """A part's bytes as the seekable file boto3 sends (and rewinds for a retry), served as views: no copy."""

    def __init__(self, view: memoryview):
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence] + pos
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        chunk, self.pos = self.view[self.pos:end], max(self.pos, end)
        return chunk

    def readinto(self, b):
        chunk = self.read(len(b))
        b[:len(chunk)] = chunk
        return len(chunk)

    def __len__(self):
        return len(self.view)


class MultipartSink(DataSink):
    """A rank's data object, written in order as a multipart upload (or one PUT when it stays under a part).

    A submit of `PART_MIN` bytes or more that starts a part is uploaded from its own memory (`done()` waits for
    it: the slot is lent until then); smaller ones are copied into the part being coalesced, which goes up once
    it holds `part_bytes` (`done()` returns once the copy is made). Failures of coalesced parts surface at
    `close`."""

    def __init__(self, storage: S3Storage, url: str, nbytes: int):
        self.storage, self.path = storage, url
        self.bucket, self.key = storage.locate(url)
        # big enough that the planned bytes take at most half of MAX_PARTS: room for the objects after them
        self.part_bytes = max(PART_BYTES, round_up(-(-nbytes // (MAX_PARTS // 2)), 1 << 20))
        self.upload_id: str | None = None
        self.parts: list[tuple[int, Future]] = []  # (part number, the future of its ETag)
        self.end = 0  # bytes submitted
        self.pending: bytearray | None = None  # the part being coalesced
        self.fill = 0
        self.buffers = threading.Semaphore(2 * storage.upload_threads)

    def submit(self, buffer, offset, segments):
        if offset != self.end:
            raise OSError(errno.EINVAL, f"an object is written in order: {offset} submitted after {self.end} bytes",
                          self.path)
        n = buffer.numel()
        view = memory_of(buffer, n)
        crcs = segment_crcs(view, segments)
        self.end += n
        direct, pos = [], 0
        while pos < n:
            if self.fill == 0 and n - pos >= PART_MIN:
                take = min(n - pos, DIRECT_PART_MAX)
                direct.append(self._upload(view[pos:pos + take]))
            else:
                # the first part goes up at S3's smallest part size (or the part size, when smaller), so the
                # link starts as soon as it may
                limit = self.part_bytes if self.parts else min(PART_MIN, self.part_bytes)
                take = min(n - pos, limit - self.fill)
                if self.pending is None:
                    self.buffers.acquire()
                    self.pending = bytearray(self.part_bytes)
                self.pending[self.fill:self.fill + take] = view[pos:pos + take]
                self.fill += take
                if self.fill == limit:
                    self._ship_pending()
            pos += take
        return functools.partial(self._done, direct, crcs)

    def _done(self, direct: list[Future], crcs: list[int]) -> list[int]:
        for f in direct:
            f.result()
        return crcs

    def _upload(self, view: memoryview, release=None) -> Future:
        if self.upload_id is None:
            self.upload_id = self.storage.call(self.path, "create_multipart_upload", Bucket=self.bucket,
                                               Key=self.key)["UploadId"]
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise OSError(errno.EFBIG, f"more than {MAX_PARTS} parts: the object is too large for S3", self.path)
        future = self.storage.uploads.submit(self._put_part, number, view)
        if release is not None:
            future.add_done_callback(lambda _: release())
        self.parts.append((number, future))
        return future

    def _put_part(self, number: int, view: memoryview) -> str:
        return self.storage.call(self.path, "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                 PartNumber=number, Body=PartBody(view), ContentLength=len(view))["ETag"]

    def _ship_pending(self) -> None:
        pending, fill, self.pending, self.fill = self.pending, self.fill, None, 0
        self._upload(memoryview(pending)[:fill], release=self.buffers.release)

    def close(self, nbytes):
        if nbytes != self.end:
            raise OSError(errno.EINVAL, f"{self.end} bytes were submitted, {nbytes} closed", self.path)
        if self.upload_id is None:  # under one part: a single PUT
            body = memoryview(self.pending or b"")[:self.fill]
            self.storage.call(self.path, "put_object", Bucket=self.bucket, Key=self.key, Body=PartBody(body),
                              ContentLength=len(body))
            self.pending, self.fill = None, 0
            return
        if self.fill:
            self._ship_pending()
        done = [{"PartNumber": number, "ETag": future.result()} for number, future in self.parts]
        self.storage.call(self.path, "complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                          UploadId=self.upload_id, MultipartUpload={"Parts": done})
        self.upload_id = None

    def discard(self):
        """Let the parts in flight end, then abort the upload (its parts are freed, no object appears). Never
        raises: an upload the store cannot abort now (it is down) is aborted by `abandon` or at the next start."""
        wait([f for _, f in self.parts])
        if self.upload_id is not None:
            try:
                self.storage.call(self.path, "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                  UploadId=self.upload_id)
            except OSError as e:
                log.warning("cannot abort the upload of %s now (%s): the next start aborts it", self.path, e)
            self.upload_id = None


class RangedSource(DataSource):
    """A published data object: a read is ranged GETs of `GET_BYTES` in parallel, each straight into its slice
    of the target buffer; the segments' crc32c is computed once all have landed."""

    streams = True

    def __init__(self, storage: S3Storage, url: str):
        self.storage, self.path = storage, url
        self.bucket, self.key = storage.locate(url)
        self._size: int | None = None

    def size(self):
        if self._size is None:
            self._size = self.storage.size(self.path)
        return self._size

    def submit(self, buffer, nbytes, offset, segments):
        view = memory_of(buffer, nbytes)
        gets = [self.storage.downloads.submit(self._get, view[p:p + GET_BYTES], offset + p)
                for p in range(0, nbytes, GET_BYTES)]
        return functools.partial(self._done, gets, view, segments)

    @staticmethod
    def _done(gets: list[Future], view: memoryview, segments: list[tuple[int, int]]) -> list[int]:
        for f in gets:
            f.result()
        return segment_crcs(view, segments)

    def _get(self, view: memoryview, offset: int) -> None:
        """GET `len(view)` bytes at `offset` into `view`; a connection that breaks mid-body is asked again for
        the bytes still missing (READ_RETRIES times, sleeping 0.1 s, 0.2 s, ...)."""
        _, broken = boto_errors()
        got, failures = 0, 0
        while got < len(view):
            try:
                end = offset + len(view) - 1
                body = self.storage.call(self.path, "get_object", Bucket=self.bucket, Key=self.key,
                                         Range=f"bytes={offset + got}-{end}")["Body"]
                while got < len(view):
                    k = body.readinto(view[got:got + BODY_READ])
                    if not k:
                        raise OSError(errno.EIO, f"short read: the object ends before byte {offset + got}",
                                      self.path)
                    got += k
            except broken as e:
                failures += 1
                if failures > READ_RETRIES:
                    raise OSError(errno.EIO, f"reading bytes {offset}-{offset + len(view) - 1} of {self.path} "
                                             f"broke {failures} times: {e}", self.path) from e
                time.sleep(0.1 * 2 ** (failures - 1))


@dataclasses.dataclass(frozen=True)
class S3Options(Options):
    """How an object store is written and read: multipart uploads on `writer_threads` threads, ranged GETs on
    `read_threads`. Nothing else: an acknowledged PUT is durable (no fsync), a read lands straight in its target
    (no read mode, no O_DIRECT)."""


class S3Storage(Storage):
    """Objects under URLs that `locate` maps to (bucket, key), reached with `client` (a boto3 S3 client,
    thread-safe and shared), on the threads `options` say. A checkpoint is written in place (`in_place`: no
    rename) and is visible once its index is; a retired one is removed by rank 0 alone (`spreads_deletes` off):
    one listing and one DeleteObjects per 1000 keys, fewer requests than a DELETE per object from each rank, and
    it also removes the files of a larger earlier world."""

    in_place = True
    spreads_deletes = False
    object_store = True

    def __init__(self, locate, client, options: S3Options = S3Options()):
        self.locate, self.client, self.options = locate, client, options
        self.upload_threads = options.writer_threads
        self.uploads = ThreadPoolExecutor(options.writer_threads, thread_name_prefix="ds-s3-put")
        self.downloads = ThreadPoolExecutor(options.read_threads, thread_name_prefix="ds-s3-get")

    def call(self, url: str, operation: str, **params):
        """One S3 request about `url` (boto3 retries throttling and transient failures with backoff); a failure
        as an OSError naming `url`."""
        try:
            return getattr(self.client, operation)(**params)
        except boto_errors()[0] as e:
            raise as_oserror(e, url) from None

    def _prefix(self, url: str) -> tuple[str, str]:
        bucket, key = self.locate(url)
        return bucket, key.rstrip("/") + "/" if key else ""

    # ----- data objects -----

    def open_data(self, path, nbytes):
        return MultipartSink(self, path, nbytes)

    def open_source(self, path):
        return RangedSource(self, path)

    # ----- small objects -----

    def read_bytes(self, path):
        bucket, key = self.locate(path)
        return self.call(path, "get_object", Bucket=bucket, Key=key)["Body"].read()

    def write_bytes(self, path, data, replace=False):
        """A PUT: durable once acknowledged, and it replaces an object in one step whatever `replace` says."""
        bucket, key = self.locate(path)
        self.call(path, "put_object", Bucket=bucket, Key=key, Body=bytes(data))

    # ----- names -----

    def list(self, path):
        bucket, prefix = self._prefix(path)
        names = []
        for page in self._pages(path, "list_objects_v2", "ContinuationToken", "NextContinuationToken",
                                Bucket=bucket, Prefix=prefix, Delimiter="/"):
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            names += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
        return [n for n in names if n]  # not the prefix itself (SeaweedFS keeps an emptied one as a marker)

    def stat(self, path):
        head = self._head(path)
        return None if head is None else Stat(head["ContentLength"], (head["ETag"], head["LastModified"],
                                                                      head["ContentLength"]))

    def exists(self, path):
        if self._head(path) is not None:
            return True
        bucket, prefix = self._prefix(path)
        return self.call(path, "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0) > 0

    def remove(self, path):
        """Everything under the prefix `path/` (open multipart uploads aborted, objects deleted in batches), or
        else the object `path`."""
        bucket, prefix = self._prefix(path)
        uploads = self._uploads(path, bucket, prefix)
        for upload in uploads:
            self.call(path, "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        keys = [o["Key"] for page in self._pages(path, "list_objects_v2", "ContinuationToken",
                                                 "NextContinuationToken", Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", [])]
        if not uploads and not keys:
            self._delete_key(path)
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start:start + DELETE_BATCH]]
            reply = self.call(path, "delete_objects", Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise OSError(errno.EIO, f"cannot delete {first.get('Key')}: {first.get('Message')}", path)

    # ----- publication -----

    def stage(self, final, marker):
        """The final prefix itself, once the marker an earlier save of the same iteration left there is deleted
        (that one is invisible from then on)."""
        final = paths.normalize(final)
        self._delete_key(paths.join(final, marker))
        return final

    def commit(self, partial, final, replace=True):
        """Nothing: the index's PUT made the checkpoint visible, in place."""
        return []

    def retire(self, path, marker):
        """Its marker deleted: no reader sees it; the rest goes with `remove`."""
        self._delete_key(paths.join(path, marker))
        return path

    def abort_uploads(self, root):
        bucket, prefix = self._prefix(root)
        aborted = []
        for upload in self._uploads(root, bucket, prefix):
            self.call(root, "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted.append(f"{root} (an open multipart upload of {upload['Key']})")
        return aborted

    def close(self):
        self.uploads.shutdown()
        self.downloads.shutdown()

    # ----- requests -----

    def _head(self, url: str) -> dict | None:
        bucket, key = self.locate(url)
        try:
            return self.call(url, "head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None

    def _delete_key(self, url: str) -> None:
        bucket, key = self.locate(url)
        self.call(url, "delete_object", Bucket=bucket, Key=key)

    def _pages(self, url: str, operation: str, token_in: str, token_out: str, **params):
        """Every page of a listing request."""
        while True:
            page = self.call(url, operation, **params)
            yield page
            if not page.get("IsTruncated"):
                return
            params[token_in] = page[token_out]

    def _uploads(self, url: str, bucket: str, prefix: str) -> list[dict]:
        uploads, params = [], {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self.call(url, "list_multipart_uploads", **params)
            uploads += page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return uploads
            params.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])


def client(endpoint: str | None, region: str | None, profile: str | None, connections: int, credentials=None):
    """A boto3 S3 client: standard retries (throttling and transient errors, with backoff; AWS_MAX_ATTEMPTS,
    default 5), path-style addressing (a bucket need not be a host name: SeaweedFS, MinIO), and no checksum of
    its own on requests (every chunk carries this engine's crc32c, checked at every load). Clients are shared
    per configuration: making one costs tens of milliseconds."""
    return _client(endpoint, region, profile, connections, tuple(credentials or ()),
                   int(os.environ.get("AWS_MAX_ATTEMPTS", 5)))


@functools.lru_cache(maxsize=16)
def _client(endpoint, region, profile, connections, credentials, attempts):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImportError("s3:// and msc:// checkpoints need boto3: pip install 'datastates-llm[s3]'") from None
    keys = dict(zip(("aws_access_key_id", "aws_secret_access_key", "aws_session_token"), credentials))
    session = boto3.Session(profile_name=profile, region_name=region, **keys)
    config = Config(retries={"mode": "standard", "total_max_attempts": attempts},  # "max_attempts" counts retries
                    max_pool_connections=connections, s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return session.client("s3", endpoint_url=endpoint, config=config)


def s3_url_location(url: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    bucket, _, key = paths.normalize(url)[len("s3://"):].partition("/")
    if not bucket:
        raise CheckpointError(f"{url!r}: an s3:// path names a bucket: s3://bucket/prefix")
    return bucket, key


def s3_storage(options: S3Options = S3Options()) -> S3Storage:
    """The backend of s3:// paths: endpoint, region, profile and credentials from the standard AWS variables and
    files (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, AWS_ACCESS_KEY_ID, ...)."""
    env = os.environ.get
    profile = env("AWS_PROFILE")
    keys = None if profile else tuple(env(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                        "AWS_SESSION_TOKEN") if env(k))
    c = client(env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL"), env("AWS_REGION") or env("AWS_DEFAULT_REGION"),
               profile, max(options.writer_threads, options.read_threads) + 2, keys)
    return S3Storage(s3_url_location, c, options)

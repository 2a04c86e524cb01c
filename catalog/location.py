"""Where a traces root lives: a local folder, or a prefix on an object store (``s3://bucket/prefix``).

The one owner of that question. Every stage turns the user's ``--out`` / ``--traces`` text into
a root with :func:`root` and builds paths under it with ``/``: a local root is a plain
:class:`pathlib.Path` (nothing changes for local traces), a remote one a ``universal_pathlib``
``UPath`` over an fsspec filesystem (s3fs), which has the same API (``/``, ``glob``,
``read_text``, ``is_file``, ``stat``, ``unlink``). What differs between the two is answered here
and only here:

* :func:`is_remote`, :func:`display` (what messages print);
* reading Parquet: :func:`read_table`, :func:`read_schema`, :func:`parquet_file` hand pyarrow the
  fsspec filesystem (``filesystem=``) for remote paths;
* :func:`mkdir` (a no-op on an object store: prefixes exist when objects do), :func:`remove_tree`,
  :func:`listing` (name, size, version of every object: :func:`catalog.runs.dataset_version`);
* :func:`lock`: a :class:`filelock.FileLock` beside local files, a :class:`Lease` object on an
  object store (created with a conditional put, ``If-None-Match: *``, renewed while held,
  taken over only once expired, with ``If-Match`` on the expired lease's ETag);
* :func:`duckdb_filesystem`: the filesystem DuckDB registers to read ``s3://`` globs (no DuckDB
  extension is downloaded).

Endpoint, region and credentials come from the usual environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``: botocore reads them)
and from ``--storage-options FILE.toml`` (:func:`load_storage_options`: keys passed to the
filesystem, e.g. ``endpoint_url``, ``key``, ``secret``, ``[client_kwargs]``), which a CLI
installs for its process with :func:`use_storage_options` before calling :func:`root`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from moe_spec.errors import UserError

SCHEMES = ("s3",)  # object stores a traces root may be on (the tested one: S3 and its clones)
MAX_LEASE_SECONDS = 86_400.0  # a stated expiry further than this from the write is absurd
LEASE_SECONDS_ENV = "MOESPEC_LEASE_SECONDS"  # a lease's lifetime without renewal (default 60)
DEFAULT_LEASE_SECONDS = 60.0

# s3fs caches listings per filesystem instance: other processes (a second capture, a worker)
# add parts that a cached listing would hide, so listings are never cached
_DEFAULTS = dict(use_listings_cache=False)
_options: dict = {}


class LocationError(UserError, ValueError):
    """A traces root that cannot be used (unknown scheme, no bucket, unreachable store); the
    message is one line for the user."""


def use_storage_options(options: dict | None) -> None:
    """Filesystem options for every remote root this process opens (a CLI's
    ``--storage-options``); None or {} leaves the environment variables alone in charge."""
    _options.clear()
    _options.update(options or {})


def storage_options() -> dict:
    """The options :func:`use_storage_options` installed in this process (a copy; {} for none):
    what a worker process started afresh must be given to open the same roots."""
    return dict(_options)


def load_storage_options(path: str | Path | None) -> dict:
    """The table of a ``--storage-options`` TOML file (``endpoint_url = "http://…"``,
    ``key``/``secret``, ``[client_kwargs] region_name = "…"``); {} for None."""
    if path is None:
        return {}
    import tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise LocationError(f"cannot read --storage-options {path}: {exc.strerror or exc}") \
            from None
    except tomllib.TOMLDecodeError as exc:
        raise LocationError(f"--storage-options {path} is not valid TOML ({exc})") from None


def add_storage_options_argument(parser) -> None:
    """``--storage-options FILE.toml`` on a CLI that takes a traces root."""
    parser.add_argument("--storage-options", default=None, metavar="FILE.toml",
                        help="object-store settings for an s3:// traces root, passed to the "
                             "filesystem (endpoint_url, key, secret, [client_kwargs]); "
                             "default: the AWS_* environment variables")


def from_args(text, storage_options_file=None):
    """:func:`root` of a CLI's traces option, after installing its ``--storage-options``."""
    if storage_options_file is not None:
        use_storage_options(load_storage_options(storage_options_file))
    return root(text)


def is_remote(path) -> bool:
    """Whether ``path`` (a root or a path under one) is on an object store."""
    return not isinstance(path, (str, Path)) and getattr(path, "protocol", "") not in ("", "file",
                                                                                       "local")


def scheme_of(text: str) -> str | None:
    return text.split("://", 1)[0].lower() if "://" in text else None


def root(text) -> Path:
    """The traces root that ``text`` names: a local folder (a plain :class:`Path`), ``file://…``
    (local too) or ``s3://bucket/prefix`` (a ``UPath``; the bucket must exist). A path object is
    returned as it is."""
    if not isinstance(text, str):
        return text
    scheme = scheme_of(text)
    if scheme is None:
        return Path(text)
    if scheme == "file":
        return Path(text.split("://", 1)[1])
    if scheme not in SCHEMES:
        stores = ", ".join(f"{s}://bucket/prefix" for s in SCHEMES)
        raise LocationError(f"{text}: unknown storage scheme {scheme}://; traces live in a local "
                            f"folder or on an object store ({stores})")
    bucket = text.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise LocationError(f"{text} names no bucket; write {scheme}://bucket/prefix")
    try:
        import s3fs  # noqa: F401 - the filesystem UPath opens for s3://
        from upath import UPath
    except ImportError:
        raise LocationError(f"{text}: traces on an object store need s3fs and universal_pathlib; "
                            "pip install -e .[s3]") from None
    path = UPath(text.rstrip("/"), **{**_DEFAULTS, **_options})
    key = (bucket, json.dumps(_options, sort_keys=True, default=str))
    if key not in _checked:  # once per bucket and options in a process
        _check_bucket(path, bucket)
        _checked.add(key)
    return path


_checked: set = set()


def _check_bucket(path, bucket: str) -> None:
    """One request that the bucket is there and reachable with these credentials, answered by
    an S3 endpoint (not, say, a web server answering HTML: :func:`_not_s3`); every failure
    becomes one line."""
    try:
        answer = path.fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError as exc:
        _refuse_if_not_s3(path, bucket, exc)
        raise LocationError(f"bucket {bucket!r} of {path} does not exist at "
                            f"{_endpoint(path)}; create it or fix the URI") from None
    except PermissionError as exc:
        _refuse_if_not_s3(path, bucket, exc)
        raise LocationError(f"access to bucket {bucket!r} denied ({_first(exc)}); check "
                            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or --storage-options") \
            from None
    except Exception as exc:  # noqa: BLE001 - connection refused, no credentials, bad endpoint
        _refuse_if_not_s3(path, bucket, exc)
        raise LocationError(f"cannot reach {path} ({type(exc).__name__}: {_first(exc)}); check "
                            "AWS_ENDPOINT_URL and the credentials, or --storage-options") from None
    _refuse_if_not_s3(path, bucket, answer)


def _not_s3(response) -> str | None:
    """What an HTTP answer to an S3 request looked like when it came from something that does
    not speak S3 (no S3 header, ``x-amz…``, and a body that is not XML: a web server's page);
    None when it may be S3 or nothing can be told. ``response``: botocore's parsed response,
    or the exception (whose cause is botocore's ClientError) raised for it."""
    if isinstance(response, BaseException):
        found = None
        for exc in (response, response.__cause__, response.__context__):
            found = getattr(exc, "response", None) if exc is not None else None
            if isinstance(found, dict):
                break
        response = found
    if not isinstance(response, dict):
        return None
    meta = response.get("ResponseMetadata") or {}
    headers = {str(k).lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}
    if any(k.startswith(("x-amz", "x-goog", "x-minio", "x-rgw")) for k in headers):
        return None
    kind = headers.get("content-type", "")
    if not kind or "xml" in kind.lower():  # S3 answers XML, or nothing (a HEAD)
        return None
    server = headers.get("server")
    return (f"HTTP {meta.get('HTTPStatusCode', '?')} {kind.split(';')[0]}"
            + (f" from {server}" if server else "") + ", no S3 headers")


def _refuse_if_not_s3(path, bucket: str, response) -> None:
    problem = _not_s3(response)
    if problem:
        raise LocationError(f"{_endpoint(path)} does not speak S3 (asked for bucket {bucket!r} "
                            f"of {path}, it answered {problem}); check AWS_ENDPOINT_URL or "
                            "--storage-options endpoint_url") from None


def _endpoint(path) -> str:
    opts = path.storage_options
    return (opts.get("endpoint_url") or opts.get("client_kwargs", {}).get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint")


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def display(path) -> str:
    """How messages name ``path``: ``s3://bucket/key`` or the local path."""
    return str(path) if is_remote(path) else Path(path).as_posix()


def fs_path(path) -> str:
    """A remote path as its filesystem's key (``bucket/key``, no scheme)."""
    return path.path


# --- Parquet through pyarrow -----------------------------------------------------------------
def _source(source):
    """(what pyarrow reads, filesystem): local paths unchanged, remote ones as keys + fsspec."""
    many = isinstance(source, (list, tuple))
    first = source[0] if many and source else source
    if not is_remote(first):
        return ([str(p) for p in source] if many else source), None
    keys = [fs_path(p) for p in source] if isinstance(source, (list, tuple)) else fs_path(source)
    return keys, first.fs


def read_table(source, **kwargs):
    """:func:`pyarrow.parquet.read_table` of a file, a folder or a list of files, local or
    remote."""
    import pyarrow.parquet as pq
    where, fs = _source(source)
    if fs is None:
        return pq.read_table(where, **kwargs)
    return _read_objects(fs, where, **kwargs)


def _read_objects(fs, where, **kwargs):
    """Remote Parquet read whole: each object is fetched with one GET (all of them concurrently,
    ``fs.cat``) and decoded from memory, instead of pyarrow's HEAD and ranged reads per file. A
    folder means its ``*.parquet`` objects whose names do not start with ``.`` or ``_`` (what
    pyarrow's dataset discovery reads); its rows come in name order, as pyarrow's do."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    keys = list(where) if isinstance(where, list) else [where]
    if not isinstance(where, list) and not where.endswith(".parquet"):  # a folder
        keys = sorted(k for k in fs.find(where) if k.endswith(".parquet")
                      and not k.rsplit("/", 1)[-1].startswith((".", "_")))
        if not keys:
            return pq.read_table(where, filesystem=fs, **kwargs)  # pyarrow's own error/empty
    blobs = fs.cat(keys, on_error="raise")
    tables = [pq.read_table(pa.BufferReader(blobs[k]), **kwargs) for k in keys]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def read_frame(files: list):
    """A polars frame of Parquet files (:func:`polars.read_parquet`), local or remote."""
    import polars as pl
    if not files or not is_remote(files[0]):
        return pl.read_parquet(files)
    import io
    return pl.concat([pl.read_parquet(io.BytesIO(p.read_bytes())) for p in files])


def read_schema(path):
    import pyarrow.parquet as pq
    where, fs = _source(path)
    return pq.read_schema(where, filesystem=fs) if fs else pq.read_schema(where)


def parquet_file(path, **kwargs):
    """:class:`pyarrow.parquet.ParquetFile` of a local or remote file (a context manager)."""
    import pyarrow.parquet as pq
    where, fs = _source(path)
    return pq.ParquetFile(where, filesystem=fs, **kwargs) if fs else pq.ParquetFile(where, **kwargs)


# --- folders and listings --------------------------------------------------------------------
def mkdir(path) -> None:
    """Create a local folder (and its parents); on an object store a prefix exists as soon as an
    object under it does, so nothing is created (and no bucket is ever made)."""
    if not is_remote(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def remove_tree(path, ignore_errors: bool = False) -> None:
    """Delete a folder and everything under it (every object under a prefix)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    try:
        if path.fs.find(fs_path(path)):
            path.fs.rm(fs_path(path), recursive=True)
    except OSError:
        if not ignore_errors:
            raise


def iterdir(path) -> list:
    """The entries of a folder; [] when it does not exist (an empty prefix)."""
    if is_remote(path) and not path.is_dir():
        return []
    return list(path.iterdir())


SMALL_FILE = 64 * 2**20  # bytes: the most a manifest or a result config may hold


def read_small(path, limit: int = SMALL_FILE) -> bytes:
    """The bytes of a manifest or config: only a regular file of at most ``limit`` bytes is
    read (a FIFO, a device such as ``/dev/zero``, a folder or an oversized file raises
    :class:`OSError` with a one-line reason, never hangs or fills memory)."""
    import stat
    if is_remote(path):
        size = path.stat().st_size
        if size > limit:
            raise OSError(f"{size} bytes, more than the {limit} a manifest may hold")
        return path.read_bytes()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO"
                    if stat.S_ISFIFO(st.st_mode) else "a device or special file")
            raise OSError(f"it is {kind}, not a regular file")
        if st.st_size > limit:
            raise OSError(f"{st.st_size} bytes, more than the {limit} a manifest may hold")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(f"more than the {limit} bytes a manifest may hold")
        return b"".join(chunks)
    finally:
        os.close(fd)


def file_version(st: os.stat_result) -> str:
    """What identifies one version of a local file's bytes without reading them: size,
    modification and change times, inode. The change time cannot be set back by a user, so a
    byte flipped in place with its modification time restored is a new version (the key under
    which :mod:`catalog.commit` remembers a verified content hash, and what
    :func:`catalog.dataset_version` digests)."""
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def listing(path) -> list[tuple[str, int, str]]:
    """(relative name, size, version) of every file under ``path``: the version is
    :func:`file_version` locally, the ETag (or modification time) on an object store."""
    found = []
    if is_remote(path):
        base = fs_path(path).rstrip("/") + "/"
        for key, info in sorted(path.fs.find(fs_path(path), detail=True).items()):
            if info.get("type") == "directory":
                continue
            found.append((key[len(base):] if key.startswith(base) else key, int(info["size"]),
                          str(info.get("ETag") or info.get("LastModified") or "")))
        return found
    for dirpath, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            st_ = os.stat(os.path.join(dirpath, f))
            rel = os.path.relpath(os.path.join(dirpath, f), path)
            found.append((rel, st_.st_size, file_version(st_)))
    return found


def duckdb_filesystem(root):
    """The fsspec filesystem DuckDB must register (``con.register_filesystem``) to read a remote
    root's globs; None for a local root."""
    return root.fs if is_remote(root) else None


def allowed_prefix(root) -> str:
    """What DuckDB's ``allowed_directories`` names for ``root``."""
    return str(root).rstrip("/") + "/" if is_remote(root) else str(Path(root).resolve())


# --- locks -----------------------------------------------------------------------------------
def lock(path, timeout: float = -1):
    """The lock at ``path``: a :class:`filelock.FileLock` for a local path, a :class:`Lease` on
    an object store. Both have ``acquire(timeout=…)`` (raising :class:`filelock.Timeout`),
    ``release()``, ``is_locked`` and ``with`` (waiting up to ``timeout`` s; -1: for ever)."""
    if is_remote(path):
        return Lease(path, timeout=timeout)
    from filelock import FileLock
    return FileLock(str(path), timeout=timeout)


def lease_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get(LEASE_SECONDS_ENV, DEFAULT_LEASE_SECONDS)))
    except ValueError:
        return DEFAULT_LEASE_SECONDS


class Lease:
    """A writer's lease on an object store: the object at ``path`` holds ``{"owner", "expires"}``.

    * acquire: create it with a conditional put (``If-None-Match: *``): of two writers exactly
      one succeeds, the other gets ``412 Precondition Failed``. A lease whose ``expires`` is past
      (its writer was killed) is taken over with ``If-Match: <its ETag>``, so of two writers
      taking over the same expired lease one wins.
    * while held, a daemon thread renews it every third of its lifetime (again ``If-Match`` on
      our own ETag: a lease taken over meanwhile is never overwritten) — a lease lives
      ``$MOESPEC_LEASE_SECONDS`` (60) past its last renewal, so a killed writer's run can be
      resumed a minute later.
    * release: delete it (``If-Match`` our ETag).

    Expiry compares the writers' clocks, which must agree to within the lease's lifetime.

    A malformed lease — a body that is not a JSON object with a finite number ``expires`` (say
    ``[1,2]``, ``5``, ``null``, ``{"expires": "soon"}``), or one whose ``expires`` is absurd
    (more than :data:`MAX_LEASE_SECONDS` from when the object was last written, e.g. ``1e300``)
    — is never trusted and never crashes: it counts as held for one lease lifetime (this
    writer's ``seconds``) after the object's ``LastModified``, as if a writer had just written
    it, and is taken over like an expired lease after that (``If-Match`` its ETag). While it
    counts as held, :meth:`describe` names it as malformed, in one line.
    """

    def __init__(self, path, seconds: float | None = None, timeout: float = -1):
        self.path, self.seconds, self.timeout = path, seconds or lease_seconds(), timeout
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        bucket, _, key = fs_path(path).partition("/")
        self._bucket, self._key = bucket, key

    @property
    def is_locked(self) -> bool:
        return self._etag is not None

    def holder(self) -> dict:
        """The current lease's content ({} when there is none, it cannot be read or it is not a
        JSON object)."""
        try:
            held = json.loads(self.path.fs.cat_file(fs_path(self.path)))
        except (OSError, ValueError):
            return {}
        return held if isinstance(held, dict) else {}

    def state(self) -> tuple[str, float, str | None] | None:
        """(ETag, when it expires, what is malformed about it or None) of the lease object now
        there, or None when there is none (or it cannot be read)."""
        try:
            head, expires, problem = self._state()
        except OSError:
            return None
        return str(head.get("ETag")), expires, problem

    def _state(self):
        """(head, when the lease expires, what is malformed about it or None) of the lease
        object; raises OSError (FileNotFoundError: there is none)."""
        head = self.path.fs.call_s3("head_object", Bucket=self._bucket, Key=self._key)
        body = self.path.fs.cat_file(fs_path(self.path))
        return (head, *self._expiry(body, head))

    def _expiry(self, body: bytes, head: dict) -> tuple[float, str | None]:
        """When a lease with ``body`` expires, and what is malformed about it (None: nothing):
        a malformed lease expires ``seconds`` after its object was last written."""
        modified = head.get("LastModified")
        try:
            written = float(modified.timestamp())
        except (AttributeError, TypeError, ValueError, OverflowError, OSError):
            written = time.time()  # a store that says not when: as if written just now
        try:
            held = json.loads(body)
        except ValueError:
            held = None
        value = held.get("expires") if isinstance(held, dict) else None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and abs(value - written) <= MAX_LEASE_SECONDS:
            return float(value), None
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
        text = " ".join(text.split())
        shown = repr(text[:60] + ("…" if len(text) > 60 else ""))
        problem = f"its expiry {value!r} is absurd" if number else \
            f"its content {shown} is not {{\"owner\": …, \"expires\": <seconds>}}"
        return written + self.seconds, problem

    def _body(self) -> bytes:
        return json.dumps(dict(owner=self.owner, expires=time.time() + self.seconds)).encode()

    def _put(self, **condition) -> str:
        return self.path.fs.call_s3("put_object", Bucket=self._bucket, Key=self._key,
                                    Body=self._body(), **condition)["ETag"]

    def _try(self) -> bool:
        try:
            self._etag = self._put(IfNoneMatch="*")
            return True
        except (FileExistsError, OSError):
            pass
        try:  # held: take it over only if it has expired (a malformed one: see the docstring)
            head, expires, _ = self._state()
        except (FileNotFoundError, OSError):
            return False  # released meanwhile: the next attempt creates it
        if expires > time.time():
            return False
        try:
            self._etag = self._put(IfMatch=head["ETag"])
            return True
        except OSError:  # someone else took it over (or renewed it) first
            return False

    def acquire(self, timeout: float | None = None, poll_interval: float = 0.5):
        from filelock import Timeout
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while not self._try():
            if deadline is not None and time.monotonic() >= deadline:
                raise Timeout(str(self.path))
            time.sleep(poll_interval)
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name=f"lease {self.path}")
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self._etag = self._put(IfMatch=self._etag)
            except OSError:  # taken over (we were presumed dead) or unreachable: stop renewing
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._etag is None:
            return
        try:
            self.path.fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key,
                                 IfMatch=self._etag)
        except OSError:  # taken over meanwhile, or a store without conditional deletes
            try:
                head = self.path.fs.call_s3("head_object", Bucket=self._bucket, Key=self._key)
                if head["ETag"] == self._etag:
                    self.path.fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key)
            except OSError:
                pass  # gone, or someone else's now
        self._etag = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def describe(self) -> str:
        """Who holds the lease and until when, for a refusal's message (one line; a malformed
        lease is named as such)."""
        try:
            _, expires, problem = self._state()
        except OSError:
            return f"{self.path} is held"
        until = time.strftime("%H:%M:%S UTC", time.gmtime(expires))
        if problem:
            return (f"{self.path} holds a malformed lease ({problem}); it counts as held until "
                    f"{until}, {self.seconds:g} s after it was last written, then it is taken "
                    "over (delete it sooner if no capture is running)")
        owner = " ".join(str(self.holder().get("owner", "?")).split())[:100]
        return f"{self.path} is held by {owner} until {until} unless renewed"

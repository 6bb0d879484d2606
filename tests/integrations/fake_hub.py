"""A Hugging Face Hub on loopback that speaks the HTTP upload API ``create_repo`` + ``upload_folder`` use.

Standard library only: a ``ThreadingHTTPServer`` bound to 127.0.0.1 on a free port, state kept in memory.

What huggingface_hub 2.4 sends, read from ``hf_api.py``, ``_commit_api.py``, ``lfs.py`` and ``_upload_pipeline.py``,
and what this server answers:

- ``POST /api/repos/create`` ``{"name", "organization", "visibility"?, "type"}``: 200 ``{"url"}``; 409 with the
  ``url`` too when the repo exists (``exist_ok=True`` reads it and leaves the visibility as it was, as on the Hub).
- ``POST /api/models/{repo}/branch/{branch}``: a branch from main's head (``create_branch``); 409 when it exists.
- ``GET /api/models/{repo}[/revision/{rev}]`` (``repo_info``, sent when every file is unchanged): ``id``, ``sha``,
  ``private``, ``siblings``.
- ``POST /api/models/{repo}/preupload/{rev}`` ``{"files": [{path, sample (base64 of the first 512 bytes), size}]}``:
  ``uploadMode`` ``"lfs"`` for LFS-tracked suffixes (the Hub's default ``.gitattributes`` list), files of 10 MiB or
  more and samples holding a NUL byte, else ``"regular"``; ``oid`` of the file already at that path (git blob sha1 for
  regular files, sha256 for LFS ones) so that the client drops unchanged files; ``shouldIgnore`` false.
- ``POST /{repo}.git/info/lfs/objects/batch`` (git-lfs batch API): transfer ``"basic"``; per object an ``upload``
  action (PUT to this server) and a ``verify`` action, or no actions when the object is already stored.
- ``PUT /_lfs/{repo}/{oid}``: the object's bytes, checked against the announced size and the sha256 ``oid``. Like a
  presigned storage URL it needs no Authorization header (the client sends none).
- ``POST /_lfs/{repo}/{oid}/verify`` ``{"oid", "size"}``: 200 when stored with that size, 404 otherwise.
- ``POST /api/models/{repo}/commit/{rev}[?create_pr=1]``, NDJSON: one ``header`` line (``summary``, ``description``,
  ``parentCommit``?) then ``file`` (base64 ``content``), ``lfsFile`` (``oid``, ``size``), ``deletedFile`` and
  ``deletedFolder`` lines. An LFS file must have been PUT; an LFS-tracked file sent inline is refused, as the Hub
  refuses binaries in git. Answers ``commitUrl``, ``commitOid`` and, for ``create_pr=1``, ``pullRequestUrl`` (the
  commit then lands on a new ``refs/pr/N`` branched from main).

Xet: in huggingface_hub 2.4 the server has no say in it. ``upload_folder`` and ``preupload_lfs_files`` call
``utils._runtime.is_xet_available()``, which is ``hf_xet`` importable and not ``constants.HF_HUB_DISABLE_XET``
(``HF_HUB_DISABLE_XET`` read once, at import). When it holds, ``upload_folder`` goes through
``_upload_pipeline.pipelined_upload`` and every file the preupload answer marks ``"lfs"`` is chunked by ``hf_xet``,
which fetches a CAS token from ``GET /api/models/{repo}/xet-write-token/{rev}`` and uploads xorbs and shards to the CAS
server it names: the LFS batch endpoint is never called and there is no fallback to it, whatever the server answers.
Only when Xet is off does ``upload_folder`` take the single
``create_commit`` path: preupload, LFS batch with ``transfers=["basic", "multipart"]``, one PUT per object (no
``chunk_size`` in the action header, so no multipart), verify, commit. Tests therefore switch Xet off on the client
(``constants.HF_HUB_DISABLE_XET`` and, for spawned ranks, the environment variable). With Xet left on, a push to this
server fails within a second: preupload, then ``hf_xet`` gets a 404 from ``xet-write-token`` and huggingface_hub
raises a ``ConnectionError`` (tried with hf_xet installed in this venv). This server does not implement
the Xet CAS protocol; any route it does not know answers 404 and is recorded in ``unhandled``, so a test can assert
that the client sent nothing unexpected.

Failure injection: ``fail(route, status=..., repo_id=...)`` makes a route answer an error whose message echoes the
request's Authorization header, like a misconfigured proxy would, so that callers' token redaction can be tested.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

logger = logging.getLogger(__name__)

# The suffixes the Hub's default .gitattributes sends to LFS (the ones a model folder can hold).
LFS_SUFFIXES: tuple[str, ...] = (
    ".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib", ".mlmodel", ".model",
    ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb", ".pickle", ".pkl", ".pt", ".pth", ".rar",
    ".safetensors", ".tar", ".tflite", ".tgz", ".wasm", ".xz", ".zip", ".zst",
)
LFS_MIN_SIZE = 10 * 1024 * 1024

ROUTES = ("create_repo", "create_branch", "repo_info", "preupload", "lfs_batch", "lfs_upload", "lfs_verify", "commit")


class _HttpError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


@dataclass
class _Branch:
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)  # path -> "regular" | "lfs": how the file arrived
    commits: list[str] = field(default_factory=list)  # oldest first; the last one is the head
    summaries: list[str] = field(default_factory=list)  # the commit messages' summaries, as commits

    @property
    def head(self) -> str:
        return self.commits[-1]

    def copy(self) -> "_Branch":
        return _Branch(dict(self.files), dict(self.modes), list(self.commits), list(self.summaries))


@dataclass
class _Repo:
    private: bool
    branches: dict[str, _Branch]
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes
    announced: dict[str, int] = field(default_factory=dict)  # sha256 -> size, from the batch call
    next_pr: int = 1


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    route: str | None  # None: no route matched
    authorization: str | None


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as the oid of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Start with ``FakeHub()`` (or ``with FakeHub() as hub``); point ``HfApi(endpoint=hub.endpoint)`` at it.

    ``token``: when given, every request but the LFS PUT must carry ``Authorization: Bearer <token>`` (401 otherwise).
    """

    def __init__(self, *, token: str | None = None, lfs_suffixes: tuple[str, ...] = LFS_SUFFIXES) -> None:
        self.token = token
        self.lfs_suffixes = lfs_suffixes
        self.requests: list[Request] = []
        self.unhandled: list[str] = []
        self._repos: dict[str, _Repo] = {}
        self._failures: dict[tuple[str, str | None], int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-hub", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ lifecycle and inspection

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files at the head of ``revision``: path -> bytes."""
        with self._lock:
            return dict(self._branch(repo_id, revision).files)

    def upload_modes(self, repo_id: str, revision: str = "main") -> dict[str, str]:
        """How each file at the head of ``revision`` arrived: ``"regular"`` (inline in the commit) or ``"lfs"``."""
        with self._lock:
            return dict(self._branch(repo_id, revision).modes)

    def commits(self, repo_id: str, revision: str = "main") -> list[str]:
        """Commit oids of ``revision``, oldest first (the first one is the repo's initial commit)."""
        with self._lock:
            return list(self._branch(repo_id, revision).commits)

    def commit_summaries(self, repo_id: str, revision: str = "main") -> list[str]:
        """The commit messages' summaries of ``revision``, in ``commits``' order."""
        with self._lock:
            return list(self._branch(repo_id, revision).summaries)

    def private(self, repo_id: str) -> bool:
        with self._lock:
            return self._repo(repo_id).private

    def revisions(self, repo_id: str) -> list[str]:
        with self._lock:
            return sorted(self._repo(repo_id).branches)

    @property
    def auth_headers(self) -> list[tuple[str | None, str | None]]:
        """``(route, Authorization header or None)`` for every request received, in order."""
        with self._lock:
            return [(r.route, r.authorization) for r in self.requests]

    def fail(self, route: str, *, status: int | None = 500, repo_id: str | None = None) -> None:
        """Make ``route`` (one of ``ROUTES``) answer ``status`` for ``repo_id`` (any repo when None), echoing the
        request's Authorization header in the error message. ``status=None`` lifts the failure."""
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; routes: {', '.join(ROUTES)}")
        with self._lock:
            if status is None:
                self._failures.pop((route, repo_id), None)
            else:
                self._failures[(route, repo_id)] = status

    # ------------------------------------------------------------------ request handling (called under the lock)

    def _repo(self, repo_id: str) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _HttpError(404, f"Repository Not Found for url: {repo_id}")
        return repo

    def _branch(self, repo_id: str, revision: str) -> _Branch:
        branch = self._repo(repo_id).branches.get(revision)
        if branch is None:
            raise _HttpError(404, f"Invalid rev id: {revision}")
        return branch

    def _check(self, route: str, repo_id: str, authorization: str | None) -> None:
        status = self._failures.get((route, repo_id), self._failures.get((route, None)))
        if status is not None:
            raise _HttpError(status, f"fake hub: injected failure on {route} (request had Authorization: "
                                     f"{authorization})")
        if self.token is not None and route != "lfs_upload" and authorization != f"Bearer {self.token}":
            raise _HttpError(401, "Invalid credentials in Authorization header")

    def _mode(self, path: str, size: int, sample: bytes) -> str:
        if path.lower().endswith(self.lfs_suffixes) or size >= LFS_MIN_SIZE or b"\0" in sample:
            return "lfs"
        return "regular"

    def _oid(self, branch: _Branch, path: str) -> str | None:
        if path not in branch.files:
            return None
        data = branch.files[path]
        return hashlib.sha256(data).hexdigest() if branch.modes[path] == "lfs" else git_blob_sha1(data)

    def _url(self, *parts: str) -> str:
        return "/".join([self.endpoint, *parts])

    def agent_harnesses(self, auth: str | None, query: dict, body: bytes) -> dict:
        """The registry huggingface_hub fetches (at most daily) to tag its user agent: an empty one here."""
        return {"standardEnvVars": [], "harnesses": {}}

    def create_repo(self, auth: str | None, query: dict, body: bytes) -> dict:
        payload = json.loads(body)
        if payload.get("type", "model") != "model":
            raise _HttpError(400, f"fake hub: only model repos, got type {payload.get('type')!r}")
        if not payload.get("organization"):
            raise _HttpError(400, "fake hub: repo ids need a namespace ('owner/name')")
        repo_id = f"{payload['organization']}/{payload['name']}"
        self._check("create_repo", repo_id, auth)
        if repo_id in self._repos:
            raise _HttpError(409, "You already created this model repo", url=self._url(repo_id))
        initial = hashlib.sha1(f"initial commit of {repo_id}".encode()).hexdigest()
        self._repos[repo_id] = _Repo(private=payload.get("visibility") == "private",
                                     branches={"main": _Branch(commits=[initial], summaries=["initial commit"])})
        return {"url": self._url(repo_id), "name": repo_id}

    def create_branch(self, auth: str | None, query: dict, body: bytes, repo_id: str, rev: str) -> dict:
        self._check("create_branch", repo_id, auth)
        repo = self._repo(repo_id)
        if rev in repo.branches:
            raise _HttpError(409, f"Reference already exists: {rev}")
        start = (json.loads(body) if body else {}).get("startingPoint") or "main"
        repo.branches[rev] = self._branch(repo_id, start).copy()
        return {}

    def repo_info(self, auth: str | None, query: dict, body: bytes, repo_id: str, rev: str = "main") -> dict:
        self._check("repo_info", repo_id, auth)
        branch = self._branch(repo_id, rev)
        return {"id": repo_id, "modelId": repo_id, "sha": branch.head, "private": self._repo(repo_id).private,
                "siblings": [{"rfilename": path} for path in sorted(branch.files)]}

    def preupload(self, auth: str | None, query: dict, body: bytes, repo_id: str, rev: str) -> dict:
        self._check("preupload", repo_id, auth)
        branch = self._branch(repo_id, "main" if query.get("create_pr") == ["1"] else rev)
        answers = []
        for f in json.loads(body)["files"]:
            mode = self._mode(f["path"], f["size"], base64.b64decode(f["sample"]))
            oid = self._oid(branch, f["path"]) if branch.modes.get(f["path"]) == mode else None
            answers.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return {"files": answers, "commitOid": branch.head}

    def lfs_batch(self, auth: str | None, query: dict, body: bytes, repo_id: str) -> dict:
        self._check("lfs_batch", repo_id, auth)
        repo = self._repo(repo_id)
        payload = json.loads(body)
        if payload.get("operation") != "upload" or "basic" not in payload.get("transfers", ["basic"]):
            raise _HttpError(422, "fake hub: only 'upload' with the 'basic' transfer")
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in repo.lfs:
                objects.append({"oid": oid, "size": size})
                continue
            repo.announced[oid] = size
            href = self._url("_lfs", repo_id, oid)
            objects.append({"oid": oid, "size": size, "authenticated": True,
                            "actions": {"upload": {"href": href}, "verify": {"href": f"{href}/verify"}}})
        return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def lfs_upload(self, auth: str | None, query: dict, body: bytes, repo_id: str, oid: str) -> dict:
        self._check("lfs_upload", repo_id, auth)
        repo = self._repo(repo_id)
        if oid not in repo.announced:
            raise _HttpError(403, f"fake hub: object {oid} was not announced through the batch API")
        if len(body) != repo.announced[oid] or hashlib.sha256(body).hexdigest() != oid:
            raise _HttpError(400, f"fake hub: object {oid}: got {len(body)} bytes that do not hash to the oid")
        repo.lfs[oid] = body
        return {}

    def lfs_verify(self, auth: str | None, query: dict, body: bytes, repo_id: str, oid: str) -> dict:
        self._check("lfs_verify", repo_id, auth)
        payload = json.loads(body)
        stored = self._repo(repo_id).lfs.get(oid)
        if payload.get("oid") != oid or stored is None or len(stored) != payload.get("size"):
            raise _HttpError(404, f"fake hub: object {oid} is not stored with size {payload.get('size')}")
        return {}

    def commit(self, auth: str | None, query: dict, body: bytes, repo_id: str, rev: str) -> dict:
        self._check("commit", repo_id, auth)
        repo = self._repo(repo_id)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HttpError(400, "fake hub: the first NDJSON line must be the commit header")
        header = lines[0]["value"]
        create_pr = query.get("create_pr") == ["1"]
        base = self._branch(repo_id, "main" if create_pr else rev)
        parent = header.get("parentCommit")
        if parent is not None and not base.head.startswith(parent):
            raise _HttpError(412, f"fake hub: parent commit {parent} is not the head {base.head}")
        new = base.copy()
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"]
            if key == "file":
                data = base64.b64decode(value["content"])
                if self._mode(path, len(data), data[:512]) == "lfs":
                    raise _HttpError(400, f"fake hub: {path} is LFS-tracked and cannot be committed as a regular file")
                new.files[path], new.modes[path] = data, "regular"
            elif key == "lfsFile":
                data = repo.lfs.get(value["oid"])
                if data is None or ("size" in value and len(data) != value["size"]):
                    raise _HttpError(422, f"fake hub: LFS object {value['oid']} for {path} was not uploaded")
                new.files[path], new.modes[path] = data, "lfs"
            elif key == "deletedFile":
                if path not in new.files:
                    raise _HttpError(404, f"A file with this name doesn't exist: {path}")
                del new.files[path], new.modes[path]
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                for p in [p for p in new.files if p.startswith(prefix)]:
                    del new.files[p], new.modes[p]
            else:
                raise _HttpError(400, f"fake hub: unknown commit line {key!r}")
        oid = hashlib.sha1(base.head.encode() + body).hexdigest()
        new.commits.append(oid)
        new.summaries.append(header.get("summary", ""))
        answer: dict[str, Any] = {"commitUrl": self._url(repo_id, "commit", oid), "commitOid": oid, "success": True}
        if create_pr:
            number = repo.next_pr
            repo.next_pr += 1
            repo.branches[f"refs/pr/{number}"] = new
            answer["pullRequestUrl"] = self._url(repo_id, "discussions", str(number))
        else:
            repo.branches[rev] = new
        return answer


_REPO = r"(?P<repo_id>[^/]+/[^/]+)"
_ROUTE_TABLE: list[tuple[str, re.Pattern, str]] = [
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("GET", re.compile(r"/api/agent-harnesses"), "agent_harnesses"),
    ("POST", re.compile(rf"/api/models/{_REPO}/branch/(?P<rev>[^/]+)"), "create_branch"),
    ("GET", re.compile(rf"/api/models/{_REPO}"), "repo_info"),
    ("GET", re.compile(rf"/api/models/{_REPO}/revision/(?P<rev>[^/]+)"), "repo_info"),
    ("POST", re.compile(rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)"), "preupload"),
    ("POST", re.compile(rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)"), "commit"),
    ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/batch"), "lfs_batch"),
    ("PUT", re.compile(rf"/_lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})"), "lfs_upload"),
    ("POST", re.compile(rf"/_lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})/verify"), "lfs_verify"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer carries Content-Length
    timeout = 30  # an idle keep-alive connection frees its thread

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        logger.debug("fake hub: " + format, *args)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _dispatch(self, method: str) -> None:
        hub: FakeHub = self.server.hub  # type: ignore[attr-defined]
        body = self._read_body()
        url = urlsplit(self.path)
        auth = self.headers.get("Authorization")
        route, params = None, {}
        for m, pattern, name in _ROUTE_TABLE:
            match = pattern.fullmatch(url.path)
            if m == method and match:
                route, params = name, {k: unquote(v) for k, v in match.groupdict().items()}
                break
        with hub._lock:
            hub.requests.append(Request(method, url.path, route, auth))
            if route is None:
                hub.unhandled.append(f"{method} {url.path}")
        try:
            if route is None:
                raise _HttpError(404, f"fake hub: no route for {method} {url.path}")
            handler: Callable[..., dict] = getattr(hub, route)
            with hub._lock:
                status, answer = 200, handler(auth, parse_qs(url.query), body, **params)
        except _HttpError as err:
            status, answer = err.status, {"error": err.message, **err.extra}
        except (ValueError, KeyError, TypeError) as err:  # malformed request body
            status, answer = 400, {"error": f"fake hub: malformed request: {err!r}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

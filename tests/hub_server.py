"""A Hub-compatible HTTP server for the tests: real sockets, real ``huggingface_hub`` client, no request mocks.

It implements the endpoints that ``huggingface_hub`` (2.x), PEFT and transformers call to create a repo, upload an
atomic commit through the LFS protocol and download files again (see DESIGN.md, "Hub tests"):

- ``POST /api/repos/create``, ``POST /api/{type}s/{repo}/branch/{branch}``, ``GET /api/{type}s/{repo}/refs``
- ``GET /api/{type}s/{repo}[/revision/{rev}]`` (repo info), ``GET /api/{type}s/{repo}/commits/{rev}``,
  ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]``, ``POST /api/{type}s/{repo}/paths-info/{rev}``
- ``POST /api/validate-yaml``: a real check of the card metadata (YAML parses, key types, ``base_model`` is a repo id)
- ``POST /api/{type}s/{repo}/preupload/{rev}``, ``POST /{repo}.git/info/lfs/objects/batch``, ``PUT`` of the LFS
  object, ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON, applied atomically, honours ``parentCommit``)
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``/``X-Linked-Size``
- ``GET /api/whoami-v2``

Access control follows the Hub: tokens map to users (and their orgs) with read or write rights; anonymous requests
to a private repo get 401 with ``X-Error-Code: RepoNotFound``, other users' requests get 404; a bad token gets 401
``Invalid credentials in Authorization header``. Writes need a write token whose user owns the namespace.

Faults for the failure tests (each one applies to the next matching request(s)):

- ``fail_next(kind, status)``: answer with an HTTP error (e.g. 503) instead of handling the request;
- ``drop_next(kind, after_apply=False)``: close the connection without an answer, optionally after applying the
  commit (the "response lost" case);
- ``die_on(kind)``: read half of the request body, then stop serving entirely (listener closed, every connection
  dropped) until ``restart()``, which keeps all stored repos;
- ``refuse(repo_id)``: every write to this repo is answered 403.

``kind`` is one of ``create``, ``preupload``, ``lfs_batch``, ``lfs_put``, ``commit``, ``validate``, ``resolve``.

Example:
    ```py
    server = HubServer()
    server.add_token("hf_write", user="alice", write=True)
    # HF_ENDPOINT=server.url in a subprocess, or HfApi(endpoint=server.url, token="hf_write") in this one
    server.stop()
    ```
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

GITATTRIBUTES = b"""*.bin filter=lfs diff=lfs merge=lfs -text
*.gguf filter=lfs diff=lfs merge=lfs -text
*.pkl filter=lfs diff=lfs merge=lfs -text
*.png filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
"""
# the Hub stores these as LFS (its default .gitattributes), and anything big or binary
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".png", ".jpg", ".gguf", ".msgpack", ".h5", ".model")
LFS_MIN_SIZE = 10 * 1024 * 1024
REPO_ID = r"[A-Za-z0-9][\w.\-]*/[\w.\-]+"
# a Hub repo id, as the real validator accepts it for base_model: "name" or "namespace/name", no path syntax
BASE_MODEL_RE = re.compile(r"^(?:[A-Za-z0-9][\w\-.]{0,95}/)?[A-Za-z0-9][\w\-.]{0,95}$")
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclasses.dataclass(frozen=True)
class StoredFile:
    size: int
    sha256: str  # key into HubState.objects
    lfs: bool
    git_oid: str  # what git hashes: the content of a regular file, the pointer of an LFS file


@dataclasses.dataclass
class Commit:
    oid: str
    parent: Optional[str]
    files: dict[str, StoredFile]
    title: str
    message: str
    author: str
    date: str


@dataclasses.dataclass
class Repo:
    repo_type: str
    repo_id: str
    owner: str
    private: bool
    branches: dict[str, str] = dataclasses.field(default_factory=dict)
    commits: dict[str, Commit] = dataclasses.field(default_factory=dict)

    def resolve(self, revision: str) -> Optional[Commit]:
        revision = unquote(revision)
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        if revision.startswith("refs/heads/") and revision[11:] in self.branches:
            return self.commits[self.branches[revision[11:]]]
        if re.fullmatch(r"[0-9a-f]{7,40}", revision):
            matches = [c for oid, c in self.commits.items() if oid.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        return None

    def history(self, revision: str) -> list[Commit]:
        commit, out = self.resolve(revision), []
        while commit is not None:
            out.append(commit)
            commit = self.commits.get(commit.parent) if commit.parent else None
        return out


@dataclasses.dataclass
class Fault:
    kind: str
    action: str  # "status" | "drop" | "drop_after_apply" | "die"
    status: int = 503
    times: int = 1


@dataclasses.dataclass
class RequestRecord:
    method: str
    path: str
    kind: str
    status: Optional[int]  # None: connection dropped without an answer
    user: Optional[str]
    paths: list[str]  # file paths named in the request body (preupload, commit)


class HubState:
    """Everything the server knows; survives ``restart()`` so the tests can inspect a repo after a crash."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.objects: dict[str, bytes] = {}  # sha256 -> content, for regular and LFS files alike
        self.tokens: dict[str, tuple[str, tuple[str, ...], bool]] = {}  # token -> (user, orgs, write)
        self.faults: list[Fault] = []
        self.refused: set[str] = set()
        self.requests: list[RequestRecord] = []
        self.dead = False
        self._counter = 0

    def take_fault(self, kind: str) -> Optional[Fault]:
        with self.lock:
            for fault in self.faults:
                if fault.kind == kind:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    def new_commit_oid(self, seed: str) -> str:
        with self.lock:
            self._counter += 1
            return hashlib.sha1(f"{seed}:{self._counter}:{time.time_ns()}".encode()).hexdigest()

    def store(self, data: bytes, path: str, force_lfs: Optional[bool] = None) -> StoredFile:
        sha = hashlib.sha256(data).hexdigest()
        self.objects[sha] = data
        lfs = is_lfs(path, len(data), data[:512]) if force_lfs is None else force_lfs
        git_oid = git_blob_oid(lfs_pointer(sha, len(data))) if lfs else git_blob_oid(data)
        return StoredFile(size=len(data), sha256=sha, lfs=lfs, git_oid=git_oid)


def is_lfs(path: str, size: int, sample: bytes) -> bool:
    return path.lower().endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE or b"\0" in sample


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None, extra: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


class _Drop(Exception):
    """Close the connection without answering."""


def validate_card_metadata(content: str) -> tuple[list[str], list[str]]:
    """The checks of ``POST /api/validate-yaml``: (errors, warnings) for a README's front matter."""
    errors: list[str] = []
    if not content.startswith("---"):
        return [], ["Empty metadata: the README has no YAML front matter."]
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, flags=re.S)
    if not match:
        return ["Unterminated YAML front matter (missing closing '---')."], []
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        return [f"YAML does not parse: {exc}"], []
    if meta is None:
        return [], ["Empty metadata."]
    if not isinstance(meta, dict):
        return [f"Metadata must be a mapping, got {type(meta).__name__}."], []

    def is_str_list(value) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    for key in ("library_name", "license", "pipeline_tag", "license_name", "license_link", "base_model_relation"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string, got {meta[key]!r}.')
    for key in ("tags", "metrics"):
        if key in meta and not is_str_list(meta[key]):
            errors.append(f'"{key}" must be a list of strings, got {meta[key]!r}.')
    for key in ("datasets", "language", "base_model"):
        if key in meta and not (isinstance(meta[key], str) or is_str_list(meta[key])):
            errors.append(f'"{key}" must be a string or a list of strings, got {meta[key]!r}.')
    if isinstance(meta.get("license"), str) and not re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", meta["license"]):
        errors.append(f'"license" must be a license identifier such as "apache-2.0", got {meta["license"]!r}.')
    base = meta.get("base_model")
    for value in [base] if isinstance(base, str) else base if is_str_list(base) else []:
        if not BASE_MODEL_RE.fullmatch(value):
            errors.append(f'"base_model" must be a Hub model id like "namespace/name", got {value!r}.')
    relation = meta.get("base_model_relation")
    if relation is not None:
        if relation not in BASE_MODEL_RELATIONS:
            errors.append(f'"base_model_relation" must be one of {BASE_MODEL_RELATIONS}, got {relation!r}.')
        if base is None:
            errors.append('"base_model_relation" requires "base_model".')
    if "model-index" in meta:
        errors.extend(_validate_model_index(meta["model-index"]))
    return errors, []


def _validate_model_index(index: Any) -> list[str]:
    if not isinstance(index, list) or not index:
        return ['"model-index" must be a non-empty list.']
    errors = []
    for entry in index:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            errors.append('"model-index" entries need a string "name".')
            continue
        results = entry.get("results")
        if not isinstance(results, list):
            errors.append('"model-index[].results" must be a list.')
            continue
        for result in results:
            task, dataset, metrics = (result or {}).get("task"), (result or {}).get("dataset"), (result or {}).get(
                "metrics"
            )
            if not isinstance(task, dict) or not isinstance(task.get("type"), str):
                errors.append('"model-index[].results[].task.type" must be a string.')
            if not isinstance(dataset, dict) or not all(isinstance(dataset.get(k), str) for k in ("type", "name")):
                errors.append('"model-index[].results[].dataset" needs string "type" and "name".')
            if not isinstance(metrics, list) or not metrics:
                errors.append('"model-index[].results[].metrics" must be a non-empty list.')
                continue
            for metric in metrics:
                if not isinstance(metric, dict) or not isinstance(metric.get("type"), str):
                    errors.append('"metrics[].type" must be a string.')
                elif not isinstance(metric.get("value"), (int, float, str)) or isinstance(metric.get("value"), bool):
                    errors.append(f'"metrics[].value" of {metric["type"]!r} must be a number or a string.')
    return errors


def _front_matter(data: bytes) -> Optional[dict]:
    match = re.match(r"^---\s*\n(.*?)\n---", data.decode("utf-8", "replace"), flags=re.S)
    if not match:
        return None
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    return meta if isinstance(meta, dict) else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_HTTPServer"

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    # -- plumbing ----------------------------------------------------------------------------------------------------
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    @property
    def hub(self) -> "HubServer":
        return self.server.hub

    @property
    def state(self) -> HubState:
        return self.server.hub.state

    def _read_body(self, limit: Optional[int] = None) -> bytes:
        self._body_consumed = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
                if limit is not None and sum(map(len, chunks)) >= limit:
                    break
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length if limit is None else min(length, limit))

    def _body_length(self) -> int:
        return int(self.headers.get("Content-Length") or 0)

    def _send(self, status: int, body: Any = b"", headers: Optional[dict] = None, head_only: bool = False) -> None:
        if isinstance(body, (dict, list)):
            payload = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        else:
            payload = body if isinstance(body, bytes) else str(body).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not head_only:
            self.wfile.write(payload)
        self._status = status

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _dispatch(self, method: str) -> None:
        self._status: Optional[int] = None
        self._body_consumed = method in ("GET", "HEAD")
        self._user: Optional[str] = None
        self._paths: list[str] = []
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        kind = self._kind(method, path)
        try:
            if self.state.dead:
                raise _Drop()
            fault = self.state.take_fault(kind) if kind else None
            if fault is not None and fault.action == "die":
                self._read_body(limit=max(self._body_length() // 2, 1))  # the upload is cut off halfway
                self.hub.die()
                raise _Drop()
            if fault is not None and fault.action == "drop":
                self._read_body()
                raise _Drop()
            if fault is not None and fault.action == "status":
                self._read_body()
                raise HttpError(fault.status, f"Injected fault: HTTP {fault.status} on {kind}.")
            self._route(method, path, query, after_apply_drop=fault is not None and fault.action == "drop_after_apply")
        except _Drop:
            self._drop()
        except HttpError as err:
            if not self._body_consumed:  # an unread body would be parsed as the next request on this connection
                self._read_body()
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send(err.status, {"error": err.message, **err.extra}, headers, head_only=method == "HEAD")
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True
        finally:
            with self.state.lock:
                self.state.requests.append(RequestRecord(method, path, kind, self._status, self._user, self._paths))

    @staticmethod
    def _kind(method: str, path: str) -> str:
        if method == "POST" and path == "/api/repos/create":
            return "create"
        if method == "POST" and path == "/api/validate-yaml":
            return "validate"
        if method == "POST" and "/preupload/" in path:
            return "preupload"
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            return "lfs_batch"
        if method == "PUT" and path.startswith("/__lfs/"):
            return "lfs_put"
        if method == "POST" and re.match(r"^/api/\w+s/" + REPO_ID + "/commit/", path):
            return "commit"
        if "/resolve/" in path:
            return "resolve"
        return ""

    # -- auth --------------------------------------------------------------------------------------------------------
    def _auth(self) -> Optional[str]:
        header = self.headers.get("Authorization")
        if not header:
            return None
        token = header.split(" ", 1)[-1].strip()
        entry = self.state.tokens.get(token)
        if entry is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        self._user = entry[0]
        return entry[0]

    def _can_write(self, user: Optional[str], namespace: str) -> bool:
        for token, (name, orgs, write) in self.state.tokens.items():
            if name == user:
                return write and (namespace == name or namespace in orgs)
        return False

    def _can_read(self, user: Optional[str], repo: Repo) -> bool:
        if not repo.private:
            return True
        for token, (name, orgs, write) in self.state.tokens.items():
            if name == user:
                return repo.owner == name or repo.owner in orgs
        return False

    def _repo(self, repo_type: str, repo_id: str, user: Optional[str]) -> Repo:
        repo = self.state.repos.get((repo_type, repo_id))
        if repo is None or not self._can_read(user, repo):
            # the Hub answers 401 to anonymous requests and 404 to others, with the same error code
            status = 401 if user is None else 404
            raise HttpError(status, "Repository not found", code="RepoNotFound")
        return repo

    def _writable_repo(self, repo_type: str, repo_id: str, user: Optional[str]) -> Repo:
        if user is None:
            raise HttpError(401, "You must be authenticated to write to a repository.")
        repo = self._repo(repo_type, repo_id, user)
        if repo_id in self.state.refused:
            raise HttpError(403, f"Write access to {repo_id} is refused by the server (repository is read-only).")
        if not self._can_write(user, repo_id.split("/")[0]):
            raise HttpError(403, f"You don't have the rights to write to {repo_id}.")
        return repo

    def _commit_of(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HttpError(404, f"Revision Not Found: {unquote(revision)}", code="RevisionNotFound")
        return commit

    # -- routes ------------------------------------------------------------------------------------------------------
    def _route(self, method: str, path: str, query: dict, after_apply_drop: bool = False) -> None:
        user = self._auth()
        T = r"(?P<type>model|dataset|space)s"
        R = r"(?P<repo>" + REPO_ID + ")"
        routes = [
            ("POST", r"^/api/repos/create$", self._create_repo),
            ("GET", r"^/api/whoami-v2$", self._whoami),
            ("POST", r"^/api/validate-yaml$", self._validate_yaml),
            ("POST", rf"^/api/{T}/{R}/preupload/(?P<rev>[^/]+)$", self._preupload),
            ("POST", rf"^/api/{T}/{R}/commit/(?P<rev>[^/]+)$", self._commit),
            ("POST", rf"^/api/{T}/{R}/branch/(?P<branch>.+)$", self._create_branch),
            ("GET", rf"^/api/{T}/{R}/refs$", self._refs),
            ("GET", rf"^/api/{T}/{R}/commits/(?P<rev>[^/]+)$", self._commits),
            ("GET", rf"^/api/{T}/{R}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", self._tree),
            ("POST", rf"^/api/{T}/{R}/paths-info/(?P<rev>[^/]+)$", self._paths_info),
            ("GET", rf"^/api/{T}/{R}/revision/(?P<rev>[^/]+)$", self._repo_info),
            ("GET", rf"^/api/{T}/{R}$", self._repo_info),
            ("POST", r"^/(?:(?P<prefix>datasets|spaces)/)?(?P<repo>" + REPO_ID + r")\.git/info/lfs/objects/batch$",
             self._lfs_batch),
            ("PUT", r"^/__lfs/(?P<oid>[0-9a-f]{64})$", self._lfs_put),
            ("POST", r"^/__lfs/verify$", self._lfs_verify),
            (("GET", "HEAD"), r"^/(?:(?P<prefix>datasets|spaces)/)?(?P<repo>" + REPO_ID +
             r")/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", self._resolve),
        ]
        for methods, pattern, handler in routes:
            if method in ((methods,) if isinstance(methods, str) else methods):
                match = re.match(pattern, path)
                if match:
                    groups = {k: v for k, v in match.groupdict().items()}
                    if "prefix" in groups:
                        prefix = groups.pop("prefix")
                        groups["type"] = {"datasets": "dataset", "spaces": "space"}.get(prefix or "", "model")
                    if after_apply_drop:
                        groups["after_apply_drop"] = True
                    handler(method=method, user=user, query=query, **groups)
                    return
        self._read_body()
        raise HttpError(404, f"Unknown endpoint {method} {path} (not implemented by the test Hub)")

    def _whoami(self, method, user, query):
        if user is None:
            raise HttpError(401, "Invalid username or password.")
        name, orgs, write = next(v for v in self.state.tokens.values() if v[0] == user)
        role = "write" if write else "read"
        self._send(200, {"type": "user", "name": name, "orgs": [{"name": o} for o in orgs],
                         "auth": {"accessToken": {"displayName": "test", "role": role}}})

    def _create_repo(self, method, user, query):
        payload = json.loads(self._read_body() or b"{}")
        if user is None:
            raise HttpError(401, "You must be authenticated to create a repository.")
        namespace = payload.get("organization") or user
        repo_id = f"{namespace}/{payload['name']}"
        repo_type = payload.get("type") or "model"
        private = payload.get("private", payload.get("visibility") == "private") or payload.get("visibility") in (
            "private", "protected")
        with self.state.lock:
            if repo_id in self.state.refused or not self._can_write(user, namespace):
                raise HttpError(403, f"You don't have the rights to create a repository under {namespace!r}.")
            prefix = "" if repo_type == "model" else f"{repo_type}s/"
            if (repo_type, repo_id) in self.state.repos:
                raise HttpError(409, "You already created this model repo",
                                extra={"url": f"{self.hub.url}/{prefix}{repo_id}"})
            repo = Repo(repo_type=repo_type, repo_id=repo_id, owner=namespace, private=bool(private))
            oid = self.state.new_commit_oid(repo_id)
            gitattributes = self.state.store(GITATTRIBUTES, ".gitattributes")
            repo.commits[oid] = Commit(oid, None, {".gitattributes": gitattributes}, "initial commit", "", user,
                                       _now())
            repo.branches["main"] = oid
            self.state.repos[(repo_type, repo_id)] = repo
        self._send(200, {"url": f"{self.hub.url}/{prefix}{repo_id}", "name": repo_id, "id": repo_id})

    def _validate_yaml(self, method, user, query):
        payload = json.loads(self._read_body() or b"{}")
        if not isinstance(payload.get("content"), str):
            raise HttpError(400, '"content" must be a string.')
        errors, warnings = validate_card_metadata(payload["content"])
        body = {"errors": [{"message": m} for m in errors], "warnings": [{"message": m} for m in warnings]}
        self._send(400 if errors else 200, body)

    def _preupload(self, method, user, query, type, repo, rev):
        payload = json.loads(self._read_body() or b"{}")
        self._paths = [f["path"] for f in payload.get("files", [])]
        with self.state.lock:
            r = self._writable_repo(type, repo, user)
            commit = self._commit_of(r, rev) if unquote(rev) in r.branches or r.resolve(rev) else None
            files = []
            for f in payload.get("files", []):
                sample = base64.b64decode(f.get("sample", ""))
                mode = "lfs" if is_lfs(f["path"], int(f["size"]), sample) else "regular"
                existing = commit.files.get(f["path"]) if commit else None
                oid = None
                if existing is not None:
                    oid = existing.sha256 if existing.lfs else git_blob_oid(self.state.objects[existing.sha256])
                files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send(200, {"files": files, "commitOid": commit.oid if commit else None})

    def _lfs_batch(self, method, user, query, type, repo):
        payload = json.loads(self._read_body() or b"{}")
        with self.state.lock:
            self._writable_repo(type, repo, user)
            objects = []
            for obj in payload.get("objects", []):
                entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if obj["oid"] not in self.state.objects:
                    entry["actions"] = {
                        "upload": {"href": f"{self.hub.url}/__lfs/{obj['oid']}", "header": {}},
                        "verify": {"href": f"{self.hub.url}/__lfs/verify", "header": {}},
                    }
                objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, method, user, query, oid):
        data = self._read_body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise HttpError(400, "Uploaded content does not match the LFS oid.")
        with self.state.lock:
            self.state.objects[oid] = data
        self._send(200, b"")

    def _lfs_verify(self, method, user, query):
        payload = json.loads(self._read_body() or b"{}")
        obj = self.state.objects.get(payload.get("oid", ""))
        if obj is None or len(obj) != payload.get("size"):
            raise HttpError(404, "LFS object not found")
        self._send(200, {"ok": True})

    def _commit(self, method, user, query, type, repo, rev, after_apply_drop: bool = False):
        lines = [json.loads(line) for line in self._read_body().splitlines() if line.strip()]
        with self.state.lock:
            r = self._writable_repo(type, repo, user)
            branch = unquote(rev)
            if branch not in r.branches:
                raise HttpError(404, f"Revision Not Found: {branch} is not a branch", code="RevisionNotFound")
            if not lines or lines[0].get("key") != "header":
                raise HttpError(400, "The commit payload must start with a header line.")
            header = lines[0]["value"]
            head = r.commits[r.branches[branch]]
            parent = header.get("parentCommit")
            if parent and not head.oid.startswith(parent):
                raise HttpError(412, f"Parent commit {parent} is not the head of {branch} ({head.oid}).")
            files = dict(head.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                self._paths.append(value.get("path", ""))
                if key == "file":
                    files[value["path"]] = self.state.store(base64.b64decode(value["content"]), value["path"],
                                                            force_lfs=False)
                elif key == "lfsFile":
                    data = self.state.objects.get(value["oid"])
                    if data is None:
                        raise HttpError(422, f"LFS object {value['oid']} for {value['path']} was never uploaded.")
                    files[value["path"]] = self.state.store(data, value["path"], force_lfs=True)
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HttpError(404, "A file with this name doesn't exist", code="EntryNotFound")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: f for p, f in files.items() if not p.startswith(prefix)}
                else:
                    raise HttpError(400, f"Unknown commit operation {key!r}.")
            oid = self.state.new_commit_oid(repo)
            r.commits[oid] = Commit(oid, head.oid, files, header.get("summary", ""), header.get("description", ""),
                                    user or "", _now())
            r.branches[branch] = oid
        if after_apply_drop:
            raise _Drop()
        prefix = "" if type == "model" else f"{type}s/"
        self._send(200, {"success": True, "commitOid": oid, "commitUrl": f"{self.hub.url}/{prefix}{repo}/commit/{oid}",
                         "pullRequestUrl": None})

    def _create_branch(self, method, user, query, type, repo, branch):
        payload = json.loads(self._read_body() or b"{}")
        with self.state.lock:
            r = self._writable_repo(type, repo, user)
            branch = unquote(branch)
            if branch in r.branches:
                raise HttpError(409, f"Branch {branch} already exists")
            start = self._commit_of(r, payload.get("startingPoint") or "main")
            r.branches[branch] = start.oid
        self._send(200, {})

    def _refs(self, method, user, query, type, repo):
        r = self._repo(type, repo, user)
        branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o} for n, o in r.branches.items()]
        self._send(200, {"branches": branches, "tags": [], "converts": []})

    def _commits(self, method, user, query, type, repo, rev):
        r = self._repo(type, repo, user)
        self._commit_of(r, rev)
        self._send(200, [
            {"id": c.oid, "title": c.title, "message": c.message, "date": c.date, "authors": [{"user": c.author}]}
            for c in r.history(rev)
        ])

    def _file_entry(self, path: str, f: StoredFile) -> dict:
        entry = {"type": "file", "path": path, "size": f.size, "oid": f.git_oid}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(lfs_pointer(f.sha256, f.size))}
        return entry

    def _tree(self, method, user, query, type, repo, rev, path=None):
        r = self._repo(type, repo, user)
        commit = self._commit_of(r, rev)
        path = unquote(path or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = f"{path}/" if path else ""
        if path and path in commit.files:
            raise HttpError(400, f"{path} is a file, not a folder")
        below = {p: f for p, f in commit.files.items() if p.startswith(prefix)}
        if path and not below:
            raise HttpError(404, f"Entry Not Found: {path}", code="EntryNotFound")
        entries, folders = [], set()
        for p, f in sorted(below.items()):
            rest = p[len(prefix):]
            if recursive or "/" not in rest:
                entries.append(self._file_entry(p, f))
            parts = rest.split("/")[:-1]
            for depth in range(1, len(parts) + 1 if recursive else min(len(parts), 1) + 1):
                folders.add(prefix + "/".join(parts[:depth]))
        entries += [
            {"type": "directory", "path": d, "oid": git_blob_oid(d.encode()), "size": 0} for d in sorted(folders)
        ]
        self._send(200, entries)

    def _paths_info(self, method, user, query, type, repo, rev):
        body = self._read_body()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        r = self._repo(type, repo, user)
        commit = self._commit_of(r, rev)
        out = []
        for p in paths:
            if p in commit.files:
                out.append(self._file_entry(p, commit.files[p]))
            elif any(f.startswith(p.rstrip("/") + "/") for f in commit.files):
                out.append({"type": "directory", "path": p, "oid": git_blob_oid(p.encode()), "size": 0})
        self._send(200, out)

    def _repo_info(self, method, user, query, type, repo, rev="main"):
        r = self._repo(type, repo, user)
        commit = self._commit_of(r, rev)
        readme = commit.files.get("README.md")
        card = _front_matter(self.state.objects[readme.sha256]) if readme else None
        self._send(200, {
            "_id": hashlib.md5(repo.encode()).hexdigest()[:24], "id": repo, "modelId": repo, "author": r.owner,
            "sha": commit.oid, "private": r.private, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
            "lastModified": commit.date, "createdAt": r.commits[r.history(rev)[-1].oid].date,
            "tags": list((card or {}).get("tags") or []), "library_name": (card or {}).get("library_name"),
            "cardData": card, "siblings": [{"rfilename": p, "size": f.size} for p, f in sorted(commit.files.items())],
        })

    def _resolve(self, method, user, query, type, repo, rev, path):
        r = self._repo(type, repo, user)
        commit = self._commit_of(r, rev)
        path = unquote(path)
        stored = commit.files.get(path)
        if stored is None:
            raise HttpError(404, f"Entry Not Found: {path}", code="EntryNotFound")
        data = self.state.objects[stored.sha256]
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{stored.git_oid}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if stored.lfs:
            headers.update({"X-Linked-Etag": f'"{stored.sha256}"', "X-Linked-Size": str(stored.size)})
        status = 200
        range_header = self.headers.get("Range")
        if range_header and method == "GET":
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
            if match:
                start = int(match.group(1))
                end = int(match.group(2)) if match.group(2) else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data, status = data[start:end + 1], 206
        self._send(status, data, headers, head_only=method == "HEAD")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: "HubServer"


class HubServer:
    """The test Hub: ``url``, tokens, fault injection, and read access to what was stored."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = HubState()
        self.host = host
        self.port = port
        self._httpd: Optional[_HTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        httpd = _HTTPServer((self.host, self.port), _Handler)
        httpd.hub = self
        self.port = httpd.server_address[1]
        self.state.dead = False
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def die(self) -> None:
        """Stop serving, as a crashed server would: called from a handler thread, so shut down from another one."""
        self.state.dead = True
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            def _shutdown():
                httpd.shutdown()
                httpd.server_close()

            threading.Thread(target=_shutdown, daemon=True).start()

    def restart(self) -> None:
        """Come back after ``die()`` on the same port, with every repo as it was stored."""
        self.stop()
        deadline = time.time() + 5
        while True:
            try:
                self.start()
                return
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    # -- configuration -------------------------------------------------------------------------------------------------
    def add_token(self, token: str, user: str, orgs: tuple[str, ...] = (), write: bool = True) -> None:
        self.state.tokens[token] = (user, tuple(orgs), write)

    def fail_next(self, kind: str, status: int = 503, times: int = 1) -> None:
        self.state.faults.append(Fault(kind, "status", status, times))

    def drop_next(self, kind: str, after_apply: bool = False, times: int = 1) -> None:
        self.state.faults.append(Fault(kind, "drop_after_apply" if after_apply else "drop", times=times))

    def die_on(self, kind: str) -> None:
        self.state.faults.append(Fault(kind, "die"))

    def refuse(self, repo_id: str) -> None:
        self.state.refused.add(repo_id)

    # -- inspection ----------------------------------------------------------------------------------------------------
    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.state.repos[(repo_type, repo_id)]

    def has_repo(self, repo_id: str, repo_type: str = "model") -> bool:
        return (repo_type, repo_id) in self.state.repos

    def commits(self, repo_id: str, revision: str = "main") -> list[str]:
        """Commit oids of ``revision``, newest first."""
        with self.state.lock:
            return [c.oid for c in self.repo(repo_id).history(revision)]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self.state.lock:
            commit = self.repo(repo_id).resolve(revision)
            return {p: self.state.objects[f.sha256] for p, f in commit.files.items()}

    def requests_of(self, kind: str) -> list[RequestRecord]:
        with self.state.lock:
            return [r for r in self.state.requests if r.kind == kind]


"""Object stores on loopback for tests and benchmarks: an S3-compatible server (moto's threaded
server, the one s3fs tests with) and an HTTP server that answers range requests, with faults on
demand (a status for the first N requests of a path, a delay) and a count of the bytes it served.

Both listen on 127.0.0.1 (or the address given, inside an emulated host) and stop when their
``with`` block ends."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["RangeHTTPServer", "S3Server", "S3_TEST_ENV"]

#: The credentials moto accepts; set them in the environment (DataServers inherit it).
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 on ``host`` (a free port unless ``port``): ``endpoint``, ``options`` (the
    ``storage_options`` that reach it), ``put``, ``put_tree``, ``url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
        self.host, self.port = host, port

    def __enter__(self) -> S3Server:
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def options(self) -> dict:
        return {"endpoint_url": self.endpoint}

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_TEST_ENV["AWS_DEFAULT_REGION"],
        )

    def bucket(self, name: str) -> str:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        self.bucket(bucket)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)
        return self.url(bucket, key)

    def put_tree(self, root: str | os.PathLike, bucket: str, prefix: str = "") -> str:
        """Upload every file under ``root`` to ``s3://bucket/prefix/<relative path>``; returns the
        folder's URL."""
        self.bucket(bucket)
        client, root = self.client(), Path(root)
        for p in sorted(root.rglob("*")):
            if p.is_file():
                key = "/".join(x for x in (prefix.strip("/"), p.relative_to(root).as_posix()) if x)
                client.upload_file(str(p), bucket, key)
        return self.url(bucket, prefix.strip("/"))

    def url(self, bucket: str, key: str = "") -> str:
        return f"s3://{bucket}/{key}".rstrip("/")


class RangeHTTPServer:
    """Serves the files under ``root`` over HTTP with ``Range`` support (what fsspec's HTTP
    filesystem reads by). ``fail(path, status, times)``: answer the next ``times`` requests of
    ``path`` with ``status``; ``slow(path, seconds)``: delay each answer for ``path``.
    ``fail(path, status, times, after=n)`` lets the first ``n`` requests through first (an object
    that breaks mid-read). ``served[path]``: bytes sent for it; ``requests[path]``: requests of it;
    ``answered[path]``: ``time.monotonic()`` when its last answer was sent."""

    def __init__(self, root: str | os.PathLike, host: str = "127.0.0.1", port: int = 0):
        self.root = Path(root).absolute()
        self.served: Counter = Counter()
        self.requests: Counter = Counter()
        self.answered: dict[str, float] = {}
        self._faults: dict[str, list[int | None]] = {}
        self._delays: dict[str, float] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(  # shutdown() waits up to one poll: a short one keeps tests quick
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="range-http", daemon=True
        )

    def __enter__(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, rel: str) -> str:
        return f"{self.endpoint}/{rel.lstrip('/')}"

    def fail(self, path: str, status: int, times: int = 1, after: int = 0) -> None:
        with self._lock:
            self._faults["/" + path.lstrip("/")] = [None] * after + [status] * times

    def slow(self, path: str, seconds: float) -> None:
        with self._lock:
            self._delays["/" + path.lstrip("/")] = float(seconds)

    def _fault(self, path: str) -> int | None:
        with self._lock:
            self.requests[path] += 1
            queue = self._faults.get(path)
            return queue.pop(0) if queue else None

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stall

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                import time

                path = self.path.split("?", 1)[0]
                delay = server._delays.get(path)
                if delay:
                    time.sleep(delay)
                status = server._fault(path)
                if status is not None:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                target = (server.root / path.lstrip("/")).resolve()
                if server.root not in target.parents or not target.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = target.stat().st_size
                start, end = 0, size  # end exclusive
                m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "") or "")
                if m and (m.group(1) or m.group(2)):
                    if m.group(1):
                        start = int(m.group(1))
                        end = min(int(m.group(2)) + 1, size) if m.group(2) else size
                    else:
                        start = max(size - int(m.group(2)), 0)
                    if start >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                else:
                    self.send_response(200)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    with open(target, "rb") as f:
                        f.seek(start)
                        data = f.read(end - start)
                    with server._lock:  # counted before it is sent: a client that has the bytes sees them counted
                        server.served[path] += len(data)
                    self.wfile.write(data)
                with server._lock:
                    server.answered[path] = time.monotonic()

        return Handler


def _serve(argv: list[str] | None = None) -> None:
    """``python -m helix_core.testing.objectstore s3|http --root DIR [--host A] [--port P]
    [--bucket B]``: serve ``DIR`` (uploaded into bucket ``B`` for s3) until SIGTERM; prints
    ``ready <endpoint>`` once it answers (what ``helix bench --hosts --storage`` runs on its
    storage host)."""
    import argparse
    import signal
    import sys

    p = argparse.ArgumentParser(prog="python -m helix_core.testing.objectstore")
    p.add_argument("kind", choices=("s3", "http"))
    p.add_argument("--root", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bucket", default="bench")
    a = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if a.kind == "s3":
        os.environ.update(S3_TEST_ENV)
        server: S3Server | RangeHTTPServer = S3Server(a.host, a.port)
    else:
        server = RangeHTTPServer(a.root, a.host, a.port)
    with server:
        if isinstance(server, S3Server):
            server.put_tree(a.root, a.bucket)
        print(f"ready {server.endpoint}", flush=True)
        stop.wait()
    sys.stdout.flush()


if __name__ == "__main__":
    _serve()

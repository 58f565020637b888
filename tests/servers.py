"""Real servers on loopback for the system tests: PostgreSQL, `mlflow server`, `prefect server start`.

Each is a child process in a session of its own, started into a temporary folder and stopped (its
whole process group) when the block ends. PostgreSQL is Debian's `postgresql` package (what
`make test` installs where it is missing): the server a team runs, not an embedded stand-in.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.core.net import free_port

BIN = Path(sys.executable).parent


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def start(cmd: list[str], env: dict[str, str] | None, log: Path, **kwargs) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def server_env(tmp: Path) -> dict[str, str]:
    """A child's environment with no user server, tracking URI or Prefect profile of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


# --------------------------------------------------------------------------- PostgreSQL


def postgres_bindir() -> Path | None:
    """Where `initdb`, `pg_ctl` and `postgres` are: on PATH (Debian links them into /usr/local/bin
    on some images), else Debian's /usr/lib/postgresql/<major>/bin, newest first."""
    if found := shutil.which("pg_ctl"):
        folder = Path(found).resolve().parent
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if all((folder / name).exists() for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


@dataclass(frozen=True)
class Postgres:
    """A running server: a superuser with a password, on 127.0.0.1."""

    port: int
    user: str
    password: str

    def url(self, database: str, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database ``name``; its URL (SQLAlchemy 2.1 reads `postgresql://` as psycopg 3)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, password=self.password, dbname="postgres",
            autocommit=True,
        ) as conn:  # fmt: skip
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextlib.contextmanager
def postgres_server(bindir: Path) -> Iterator[Postgres]:
    """A fresh cluster in a temporary folder, served on a free loopback port for the block.

    PostgreSQL refuses to run as root; as root it runs as Debian's `postgres` user, in a folder that
    user owns (pytest's own temporary folders are private to root)."""
    as_root = os.geteuid() == 0
    owner = pwd.getpwnam("postgres") if as_root else None
    folder = Path(tempfile.mkdtemp(prefix="posttrain-pg-"))
    data, log = folder / "data", folder / "server.log"
    password = secrets.token_hex(12)
    (folder / "pwfile").write_text(password + "\n")
    run_as = {"user": owner.pw_uid, "group": owner.pw_gid} if owner else {}
    if owner:
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        os.chown(folder / "pwfile", owner.pw_uid, owner.pw_gid)
    proc = None
    try:
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", "posttrain", "--auth=scram-sha-256",
             f"--pwfile={folder / 'pwfile'}", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=120, cwd=folder, **run_as,
        )  # fmt: skip
        port = free_port()
        proc = start(
            [str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
             "-k", str(folder), "-c", "fsync=off", "-c", "max_connections=200"],
            None, log, cwd=folder, **run_as,
        )  # fmt: skip
        server = Postgres(port, "posttrain", password)
        _wait_postgres(server, proc, log)
        yield server
    finally:
        if proc is not None:
            stop(proc, signal.SIGINT)  # PostgreSQL's "fast" shutdown
        shutil.rmtree(folder, ignore_errors=True)


def _wait_postgres(server: Postgres, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            psycopg.connect(
                host="127.0.0.1", port=server.port, user=server.user, password=server.password,
                dbname="postgres", connect_timeout=2,
            ).close()  # fmt: skip
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


# --------------------------------------------------------------------------- MLflow and Prefect


@dataclass
class Server:
    """A server process of ours in ``folder``, on a free loopback port kept across restarts."""

    folder: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    health = "/health"
    log = "server.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return server_env(self.folder)

    def start(self) -> None:
        self.port = self.port or free_port()
        self.proc = start(self.command(), self.env(), self.folder / self.log)
        wait_http(self.base_url + self.health, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    """``server`` started in its (new) folder for the block, stopped after it."""
    server.folder.mkdir(parents=True, exist_ok=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class MlflowServer(Server):
    """`mlflow server` on a backend store URI, with a local artifact destination."""

    backend: str = ""
    log = "mlflow-server.log"

    @property
    def uri(self) -> str:
        return self.base_url

    def command(self) -> list[str]:
        return [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--backend-store-uri", self.backend, "--artifacts-destination", str(self.folder / "artifacts"),
                "--workers", "1"]  # fmt: skip


@dataclass
class PrefectServer(Server):
    """`prefect server start` on a database URL (empty: Prefect's own SQLite file)."""

    database: str = ""
    health = "/api/health"
    log = "prefect-server.log"

    @property
    def api_url(self) -> str:
        return self.base_url + "/api"

    def env(self) -> dict[str, str]:
        env = server_env(self.folder)
        if self.database:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database
        return env

    def command(self) -> list[str]:
        return [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]


def prefect_cli(env: dict[str, str], *args: str, cwd: Path) -> None:
    """`prefect --no-prompt ARGS` run to its end; a failure shows its output."""
    out = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

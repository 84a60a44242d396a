"""A multi-node rendezvous that cannot form ends in bounded time, before any worker starts, in one line and status 2:
a port held by a program that never answers (torch's own client would wait forever), one that answers but is no
store, nothing listening, a port the hosting node cannot take, nodes that never join. Timeouts of a second or two."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from titanlite.commands import launch

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def listener(reply: bytes | None = None):
    """A port that accepts connections and never answers (or answers `reply` to what it reads); yields the port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    held, stop = [], threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                held.append(conn)
                if reply is not None:
                    conn.recv(64)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:  # the stuck clients read the end of the stream and give up
            conn.close()
        server.close()
        for probe in [t for t in threading.enumerate() if t.name == "rendezvous-store-probe"]:
            probe.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_job(tmp_path, port: int, conf: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        f"last_call_timeout=1,{conf}",
        "-m",
        "titanlite.commands.train",
        "--job.dump_folder",
        str(tmp_path),
    ]


def test_a_listener_that_never_answers_is_named_when_the_timeout_has_passed():
    said = []
    with listener() as port:
        start = time.monotonic()
        watch = launch.watch_store(f"127.0.0.1:{port}", 1, said.append, grace=0.2, answer=1.0)
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - start
    assert said == [
        f"RDZV_ENDPOINT=127.0.0.1:{port} accepted a connection but did not answer as a rendezvous store within 1 s: "
        f"another program holds port {port} there; {launch.WHAT_TO_CHECK}, or choose a free port"
    ]
    assert 1 < took < 5 and not watch.is_set()


def test_a_store_that_answers_settles_the_watch_at_once():
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    said: list[str] = []
    assert launch.watch_store(f"127.0.0.1:{port}", 5, said.append).wait(5) and said == []
    del server


def test_nothing_listening_on_another_node_rank_is_one_line_within_the_timeout(tmp_path, capsys):
    start = time.monotonic()
    assert launch.main(launch_job(tmp_path, free_port(), "read_timeout=1,join_timeout=1,is_host=0")) == 2
    assert time.monotonic() - start < 15
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("titanlite: error: nothing answered as a rendezvous store at RDZV_ENDPOINT=127.0.0.1:")
    assert err[-1].endswith(f"within 1 s (RDZV_TIMEOUT); {launch.WHAT_TO_CHECK}")
    assert list(tmp_path.iterdir()) == [], "the run folder the launch made for its lock is gone with it"


def test_a_program_that_answers_but_is_no_store_is_named(tmp_path, capsys):
    with listener(reply=b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        assert launch.main(launch_job(tmp_path, port, "read_timeout=1,join_timeout=1,is_host=0")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"titanlite: error: RDZV_ENDPOINT=127.0.0.1:{port} answered, but not as a rendezvous store: another program "
        f"holds port {port} there; {launch.WHAT_TO_CHECK}, or choose a free port"
    )


def test_node_rank_0_cannot_host_on_a_taken_port_and_says_so_at_once(tmp_path, capsys):
    with listener() as port:
        start = time.monotonic()
        assert launch.main(launch_job(tmp_path, port, "read_timeout=30,join_timeout=30,is_host=1")) == 2
        assert time.monotonic() - start < 10
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"titanlite: error: this node hosts the rendezvous store at RDZV_ENDPOINT=127.0.0.1:{port} (NODE_RANK=0), "
        f"but port {port} is in use by another program; stop it or choose a free port (the same RDZV_ENDPOINT on "
        "every node)"
    )


def test_nodes_that_never_join_end_within_the_join_timeout(tmp_path, capsys):
    port = free_port()
    assert launch.main(launch_job(tmp_path, port, "read_timeout=1,join_timeout=1,is_host=1")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"titanlite: error: the rendezvous at RDZV_ENDPOINT=127.0.0.1:{port} did not gather every node within 1 s "
        "(RDZV_TIMEOUT): start every node with the same NNODES, RDZV_ENDPOINT and RDZV_ID, or raise RDZV_TIMEOUT"
    )


@pytest.mark.parametrize(
    "env, line",
    [
        ({"NODE_RANK": "x"}, "NODE_RANK='x' is not a node of NNODES=2; set it to 0 on the node at RDZV_ENDPOINT and 1"),
        ({"NODE_RANK": "2"}, "NODE_RANK='2' is not a node of NNODES=2; set it to 0 on the node at RDZV_ENDPOINT and 1"),
        ({"RDZV_TIMEOUT": "0"}, "RDZV_TIMEOUT='0' is not a number of seconds; set it to 1 or more (default 300)"),
    ],
    ids=["node-rank-not-a-number", "node-rank-past-nnodes", "timeout-0"],
)
def test_run_train_refuses_a_node_rank_or_timeout_that_cannot_be(env, line):
    proc = subprocess.run(
        [str(REPO / "run_train.sh")],
        cwd=REPO,
        env={**os.environ, "TITANLITE_DEVICE": "cpu", "NNODES": "2", "RDZV_ENDPOINT": "node0:29500", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    err = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(f"titanlite: error: {line}"), proc.stderr

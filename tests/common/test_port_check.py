"""The node agent's port check halves (dtrain.common.nodeagent listen / connect), as a launch runs them on the
nodes (dtrain.control.remote.check_port): the clients start while the listener starts, so a refused connection
is tried again for a while; the listener frees its port as soon as its stdin closes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

AGENT = [sys.executable, "-m", "dtrain.common.nodeagent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_tried_again_until_the_listener_is_up():
    port = free_port()
    listening = threading.Event()

    def listen_late() -> None:
        time.sleep(1.0)  # the client has been refused a few times by now
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(4)
            listening.set()
            s.settimeout(10)
            s.accept()[0].close()

    t = threading.Thread(target=listen_late, daemon=True)
    t.start()
    argv = [*AGENT, "connect", "--to", f"127.0.0.1:{port}", "--timeout", "5", "--refused-retry", "20"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    t.join(timeout=15)
    assert listening.is_set()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["results"][0]["ok"] is True


def test_without_retry_a_refusal_is_the_answer_and_says_so():
    port = free_port()
    argv = [*AGENT, "connect", "--to", f"127.0.0.1:{port}", "--timeout", "5"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1
    result = json.loads(r.stdout)["results"][0]
    assert result["ok"] is False and result["refused"] is True, result


def test_the_listener_answers_and_frees_its_port_when_stdin_closes():
    port = free_port()
    argv = [*AGENT, "listen", "--addr", "127.0.0.1", "--port", str(port), "--seconds", "60"]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline()) == {"listening": True, "ports": [port]}
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        p.stdin.close()
        assert p.wait(timeout=10) == 0  # long before its 60 s
        with socket.socket() as s:  # the port is free again, for the job's rendezvous
            s.bind(("127.0.0.1", port))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

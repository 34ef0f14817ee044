"""A rehearsal process that imports once and forks each rehearsal: ``python -m
partita.backends.torch.rehearse_server SOCKET``.

``rehearse.run_roles`` starts a fresh ``python -m partita.backends.torch.rehearse DIR RANK...`` per
rehearsal, which imports torch, transformers and Partita first (4-5 s of CPU, half of a tiny plan's
rehearsal). Where ``PARTITA_REHEARSE_SERVER`` names the socket of this server (the test suite starts one
per test process: ``tests/conftest.py``), ``rehearse._run_process`` asks it instead: it forks, and the
child, with the caller's working directory, environment, stdout and stderr (their file descriptors
passed over the socket), runs the same body (``rehearse._child``) as the fresh process would. The fork
is taken from a process that has done nothing but import, which is the clean state ``run_roles`` needs
(no process group, no tensor, no DTensor cache). Requests are served one at a time; the reply is the
child's exit code. The server ends when its parent does.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

ENV = "PARTITA_REHEARSE_SERVER"


def request(path: str, job: tuple[str, list[int]], env: dict[str, str], fds: tuple[int, int]) -> socket.socket | None:
    """Send a rehearsal (plan directory, ranks) to the server at ``path``, to run in ``env`` and this
    working directory with ``fds`` as its stdout and stderr: the connected socket (read the exit code
    with :func:`exit_code`), or None when no server answers there (the caller starts a process itself)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        body = json.dumps({"plan_dir": job[0], "ranks": job[1], "cwd": os.getcwd(), "env": env})
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body.encode()], list(fds))
    except OSError:
        sock.close()
        return None
    return sock


def exit_code(sock: socket.socket) -> int:
    """The exit code of the rehearsal sent on ``sock`` (1 when the server went away without one)."""
    with sock:
        data = _read(sock, 4)
    return struct.unpack("!i", data)[0] if len(data) == 4 else 1


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def serve(path: str) -> None:
    """Import, listen at ``path``, and fork a ``rehearse._child`` per request until the parent is gone."""
    from partita.backends.torch import rehearse
    from partita.backends.torch.launch import load_program  # noqa: F401  (imported before the forks)

    rehearse._import_once(None)  # the imports every rehearsal makes (the model's own: per rehearsal)
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(2.0)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            head, fds, _, _ = socket.recv_fds(conn, 4, 2)
            size = struct.unpack("!I", head)[0] if len(head) == 4 else 0
            try:
                req = json.loads(_read(conn, size)) if size and len(fds) == 2 else None
                code = _fork(req, fds) if req is not None else 2
            finally:
                for fd in fds:
                    os.close(fd)
            conn.sendall(struct.pack("!i", code))


def _fork(req: dict, fds: list[int]) -> int:
    from partita.backends.torch import rehearse

    pid = os.fork()
    if pid == 0:  # the child: the caller's directory, environment and output, then rehearse._child's body
        code = 1
        try:
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            code = rehearse._child(req["plan_dir"], [int(r) for r in req["ranks"]])
        except BaseException:  # noqa: BLE001 - the caller reports a rank without a result as died
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    serve(sys.argv[1])

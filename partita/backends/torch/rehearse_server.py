"""A rehearsal process that imports once and forks each rehearsal: ``python -m
partita.backends.torch.rehearse_server SOCKET``.

``rehearse.run_roles`` starts a fresh ``python -m partita.backends.torch.rehearse DIR RANK...`` per
rehearsal, which imports torch, transformers and Partita first (4-5 s of CPU, half of a tiny plan's
rehearsal). Where ``PARTITA_REHEARSE_SERVER`` (``rehearse.SERVER_ENV``) names the socket of this server
(the test suite starts one per test process: ``tests/conftest.py``), ``rehearse._run_process`` asks it
instead (``rehearse.ask_server``): it forks, and the child, with the caller's working directory, environment, stdout and stderr (their file descriptors
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

from partita.backends.torch import rehearse


def serve(path: str) -> None:
    """Import, listen at ``path``, and fork a ``rehearse._child`` per request until the parent is gone."""
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
                req = json.loads(rehearse._read_n(conn, size)) if size and len(fds) == 2 else None
                code = _fork(req, fds) if req is not None else 2
            finally:
                for fd in fds:
                    os.close(fd)
            conn.sendall(struct.pack("!i", code))


def _fork(req: dict, fds: list[int]) -> int:
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

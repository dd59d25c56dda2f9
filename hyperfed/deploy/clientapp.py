"""A long-lived ClientApp process for one SuperNode (``flower-supernode --isolation process``).

With Flower's default ``--isolation subprocess`` the SuperNode's SuperExec starts a fresh
``flwr-clientapp`` process for every message (Flower 1.42's ``flwr-clientapp`` serves one
task token and exits): Python and torch start, and the client is rebuilt, every round. With
``--isolation process`` the SuperNode starts no app process; whatever polls its Runtime API
(``--port``) for tasks runs them. :func:`serve` is that process for hyperfed's ClientApp: it
acquires each ``flwr-clientapp`` task the SuperNode hands out (as ``flower-superexec`` does)
and runs it *in this process* (as ``flwr-clientapp`` does: pull message + context, call the
ClientApp, push reply + context, report the task's status), then waits for the next one, so
:data:`hyperfed.deploy.node._RUNTIMES` keeps the built client between messages.

The client's persistent state still travels in ``context.state`` (the SuperNode keeps it
between messages), exactly as with a fresh process per message.

It serves only ``hyperfed.deploy.flower:client_app`` and does not install the run's FAB or
its dependencies (hyperfed must be installed where it runs); for any other app, or runtime
dependency installation, use ``--isolation subprocess`` (``hyperfed flower local
--clientapp per-message``). Built on Flower 1.42's Runtime API client (flwr.supercore /
flwr.supernode internals): tested with flwr 1.42.0.

Run: ``python -m hyperfed.deploy.clientapp --runtime-api-address 127.0.0.1:9094``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from hyperfed.deploy.supernode import FIRST_POLL, POLL_INTERVAL, PollSchedule, shorten_object_pulls

log = logging.getLogger("hyperfed.clientapp")

# between task requests to the SuperNode: FIRST_POLL after a task, growing to this when idle
POLL_SECONDS = POLL_INTERVAL


def _heartbeat_fn(client: Any) -> Any:
    """Flower's task heartbeat, except that a refused heartbeat (the task expired) ends
    only that task, not this process (Flower's raises SIGINT in the one-task process)."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    req = SendTaskHeartbeatRequest()

    def fn() -> bool:
        try:
            client.SendTaskHeartbeat(req)
        except httpx.HTTPError:
            return False
        return True

    return fn


def run_task(address: str, token: str, insecure: bool, certificates: bytes | None) -> bool:
    """One ClientApp task, in this process; True when the ClientApp returned a reply."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    from hyperfed.deploy.flower import client_app

    client = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    heartbeat = HeartbeatSender(_heartbeat_fn(client))
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        heartbeat.start()
        message, context, _run, _fab = pull_task_input(client)
        reply = client_app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # the node gets an error reply; this process serves on
        log.exception("ClientApp raised")
        details = f"{type(ex)}:<'{ex}'>"
        if message is not None:
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                reply_to=message,
            )
    try:
        if reply is not None and context is not None:
            push_message(client, reply, context)
    except Exception:
        log.exception("could not push the reply")
        status = SubStatus.FAILED
    finally:
        if heartbeat.is_running:
            heartbeat.stop()
        push_task_output(client=client, context=context, sub_status=status, details=details)
        client.close()
    return status == SubStatus.COMPLETED


def serve(
    address: str,
    insecure: bool = True,
    certificates: bytes | None = None,
    poll: float = POLL_SECONDS,
    parent_pid: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Acquire and run the SuperNode's ClientApp tasks until ``stop`` is set (SIGTERM /
    SIGINT) or ``parent_pid`` (the SuperNode) is gone; returns the tasks run. Between
    requests that find no task it waits on a :class:`PollSchedule` (``FIRST_POLL`` after a
    task, growing to ``poll`` seconds)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    stop = stop or threading.Event()
    shorten_object_pulls()  # the task's message is pulled from the SuperNode's object store
    schedule = PollSchedule(FIRST_POLL, poll)
    host, _, port = address.rpartition(":")
    while not stop.is_set() and not _listening(host, int(port)):  # the SuperNode starting
        if parent_pid is not None and not _alive(parent_pid):
            return 0
        stop.wait(0.1)
    control = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    tasks = 0
    try:
        while not stop.is_set():
            if parent_pid is not None and not _alive(parent_pid):
                log.info("SuperNode %d is gone; stopping", parent_pid)
                break
            res = control.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
            )
            if res.HasField("task") and res.token:
                run_task(address, res.token, insecure, certificates)
                tasks += 1
                schedule.reset()
                continue  # another message may be waiting
            stop.wait(schedule.next())
    finally:
        control.close()
    return tasks


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host or "127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094")
    p.add_argument("--insecure", action="store_true", default=True)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--poll", type=float, default=POLL_SECONDS)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s hyperfed-clientapp %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("pid %d serving ClientApp tasks of %s", os.getpid(), args.runtime_api_address)
    t0 = time.monotonic()
    tasks = serve(args.runtime_api_address, args.insecure, None, args.poll, args.parent_pid, stop)
    log.info("stopped after %d tasks, %.0f s", tasks, time.monotonic() - t0)
    sys.exit(0)


if __name__ == "__main__":
    main()
